"""`positronic eval`: teacher-forced perplexity through a bounded cache, the probe, the outputs."""

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F

import positronic.evaluate as evaluate_module
from positronic.evaluate import (DEFAULT_TEXT, PROBE_ANSWER, PROBE_FACT, EvalError, evaluate, make_config,
                                 moving_average, probe_stream, reference_config, run_stream, segment_bounds, table,
                                 write_outputs)
from positronic.loop import Brain
from cli_helpers import TEXT, run_cli

def plain_nll(lm, ids: list[int]) -> torch.Tensor:
    """Per-token NLL of ids[1:] from one plain forward over the whole sequence."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids])).logits[0].float()
    return F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")


def test_full_cache_perplexity_equals_the_plain_models(tiny):
    ids = [tiny.bos_id] + tiny.encode(TEXT)[:120]
    report = evaluate(tiny, TEXT, policies=["none"], budgets=[200], max_tokens=120, probe=False)
    expected = plain_nll(tiny, ids)
    for run in (report.reference, report.runs[0]):
        assert run.tokens == 120
        assert torch.allclose(torch.tensor(run.nll), expected, atol=1e-4, rtol=0), run.label
        assert run.ppl == pytest.approx(math.exp(expected.mean().item()), rel=1e-4)
    assert report.runs[0].ratio == pytest.approx(1.0, abs=1e-6)


def test_a_short_stream_still_has_its_full_cache_reference(tiny):
    """The reference's budget is the stream's length + 1, which may be below what a culling
    run needs; it never culls, so it must still run (and match the plain model)."""
    report = evaluate(tiny, TEXT, policies=["streaming"], budgets=[48], max_tokens=10, probe=False)
    ids = [tiny.bos_id] + tiny.encode(TEXT)[:10]
    assert report.reference is not None and report.reference.tokens == 10
    assert torch.allclose(torch.tensor(report.reference.nll), plain_nll(tiny, ids), atol=1e-4, rtol=0)
    assert report.runs[0].ratio == pytest.approx(1.0, abs=1e-5), "10 tokens never fill a budget of 48"
    config = reference_config(3, sinks=8, protect=20)
    config.validate()
    assert config.budget >= 4 and config.policy == "none" and config.at_capacity == "stop"


def test_the_stream_is_teacher_forced_through_brain_step(tiny, monkeypatch):
    """run_stream drives a Brain: every tick is one `step(force=the text's token)`."""
    forced = []
    original = Brain.step
    monkeypatch.setattr(Brain, "step", lambda self, force=None: forced.append(force) or original(self, force))
    ids = [tiny.bos_id] + tiny.encode(TEXT)[:60]
    result = run_stream(tiny, ids, make_config("brightness", 48, repairer="self"))
    assert forced == ids[1:-1], "each token but the last is added by a forced tick, in order"
    assert len(result.nll) == 60 and result.repairs > 0 and result.max_live <= 49


def test_a_failed_tick_is_run_again_with_the_same_token(tiny, monkeypatch):
    """A failed tick adds nothing; the stream must not lose its token, so the tick is repeated.
    With nothing evicted the rebuilt cache equals the incremental one: every NLL stays."""
    ids = [tiny.bos_id] + tiny.encode(TEXT)[:60]
    config = reference_config(len(ids))
    clean = run_stream(tiny, ids, config)
    brains = []
    start = Brain.start
    monkeypatch.setattr(Brain, "start", lambda lm, *args, **kwargs: brains.append(start(lm, *args, **kwargs))
                        or brains[-1])

    def fault_at(index, stage="forward"):
        def on_token(i):
            if i == index:
                brains[-1].state.inject_fault(stage)
        return on_token

    faulty = run_stream(tiny, ids, config, on_token=fault_at(20))
    assert faulty.rebuilds == 1 and clean.rebuilds == 0
    assert brains[-1].state.live_token_ids() == ids[:-1], "no token lost, none doubled"
    assert torch.allclose(torch.tensor(faulty.nll), torch.tensor(clean.nll), atol=1e-4, rtol=0)

    # a tick that fails again when repeated ends the evaluation
    monkeypatch.setattr(Brain, "step", _fail_after_first(Brain.step))
    with pytest.raises(RuntimeError, match="failed twice"):
        run_stream(tiny, ids, config, on_token=fault_at(5))


def _fail_after_first(step):
    """Brain.step, but once a fault was injected every later tick fails as well."""
    def wrapped(self, force=None):
        record = step(self, force)
        if record.rebuilt:
            self.state.inject_fault("forward")
        return record
    return wrapped


def test_probe_scores_the_answer_tokens_as_a_plain_forward_does(tiny):
    text_ids = tiny.encode(TEXT)
    report = evaluate(tiny, TEXT, policies=["streaming"], budgets=[48], max_tokens=60, probe_filler=70)
    stream = probe_stream(tiny, text_ids, 70, keep=4)
    ids, answer_at = stream.ids, stream.answer_at
    assert ids[answer_at:] == tiny.encode(PROBE_ANSWER)
    with torch.inference_mode():
        logprobs = torch.log_softmax(tiny.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    answer = [(logprobs[i - 1], ids[i]) for i in range(answer_at, len(ids))]
    probe = report.reference.probe
    assert probe.filler == 70
    assert probe.logprob == pytest.approx(sum(float(lp[t]) for lp, t in answer), abs=1e-3)
    assert probe.logprobs == pytest.approx([float(lp[t]) for lp, t in answer], abs=1e-4)
    assert probe.ranks == [int((lp > lp[t]).sum()) + 1 for lp, t in answer]
    assert probe.recalled == all(r == 1 for r in probe.ranks)
    bounded = report.runs[0].probe
    assert bounded is not None and len(bounded.ranks) == len(answer)
    assert bounded.logprob != pytest.approx(probe.logprob, abs=1e-6), "the bounded cache saw a different context"


def test_every_policy_runs_end_to_end_and_writes_csv_json_png(tiny, tmp_path):
    report = evaluate(tiny, TEXT, policies=["brightness", "streaming", "scored", "h2o", "none"], budgets=[48],
                      max_tokens=72, segments=4, probe_filler=20, text_name="t")
    assert [r.label for r in report.runs] == [f"{p}@48" for p in ("brightness", "streaming", "scored", "h2o", "none")]
    for run in report.runs:
        assert run.tokens == 72 and len(run.segments) == 4 and run.max_live <= run.budget + 1
        assert run.ratio == pytest.approx(run.ppl / report.reference.ppl)
        assert run.deletes + run.repairs > 0, f"{run.label} never had to evict"
        assert run.probe is not None
    paths = write_outputs(report, tmp_path / "out")
    rows = list(csv.DictReader(open(paths["csv"])))
    assert [r["policy"] for r in rows][:2] == ["none", "brightness"] and rows[0]["budget"] == "full"
    assert len(rows) == 6 and float(rows[3]["ppl"]) == pytest.approx(report.runs[2].ppl, rel=1e-4)
    data = json.loads(paths["json"].read_text())
    assert len(data["runs"]) == 5 and len(data["runs"][0]["nll"]) == 72
    assert data["settings"]["budgets"] == [48]
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "streaming" in str(table(report).columns[0]._cells)


def test_brightness_cull_only_evicts_by_deleting(tiny):
    report = evaluate(tiny, TEXT, policies=["brightness"], budgets=[48], max_tokens=72, probe=False,
                      repairer="none")
    run = report.runs[0]
    assert run.repairs == 0 and run.deletes > 0 and run.max_live <= 49
    assert report.settings["repairer"] == "none"
    with pytest.raises(EvalError, match="unknown repairer 'oracle'"):
        evaluate(tiny, TEXT, policies=["brightness"], budgets=[48], repairer="oracle")


def test_none_with_stop_scores_only_what_fit(tiny):
    report = evaluate(tiny, TEXT, policies=["none"], budgets=[48], max_tokens=100, at_capacity="stop", probe=False)
    run = report.runs[0]
    assert run.stopped_at == 47 and run.tokens == 47 and run.segments[-1] is None
    assert run.ratio == pytest.approx(1.0, abs=1e-5), "nothing was evicted before it stopped"


def test_helpers():
    assert segment_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert segment_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert moving_average([1, 2, 3, 4], 2) == ([2, 3, 4], [1.5, 2.5, 3.5])


def test_bad_settings_are_refused(tiny):
    with pytest.raises(EvalError, match="unknown policy"):
        evaluate(tiny, TEXT, policies=["lru"], budgets=[48])
    with pytest.raises(EvalError, match="budget"):
        evaluate(tiny, TEXT, policies=["streaming"], budgets=[20])


def test_cli_eval_writes_table_csv_json_png(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "res"
    assert run_cli("eval", "--model", "random:tiny", "--text", str(text), "--budget", "48", "--budget", "56",
                   "--policy", "h2o", "--max-tokens", "70", "--probe-filler", "30", "--out", str(out)) == 0
    stdout = capsys.readouterr().out
    assert "h2o" in stdout and "full" in stdout and "answer NLL" in stdout and "Δ nats vs full" in stdout
    data = json.loads((out / "results.json").read_text())
    assert [run["label"] for run in data["runs"]] == ["h2o@48", "h2o@56"] and data["reference"]["label"] == "none@full"
    assert {p.name for p in out.iterdir()} == {"results.csv", "results.json", "nll_by_position.png"}
    assert DEFAULT_TEXT.is_file()


@pytest.mark.parametrize("args,message", [
    (["--policy", "lru"], "unknown policy 'lru'"),
    (["--text", "/nonexistent/x.txt"], "cannot read --text /nonexistent/x.txt"),
    (["--budget", "20"], "budget 20"),
    (["--max-tokens", "1"], "--max-tokens must be >= 2"),
    (["--probe-at", "1.5"], "--probe-at must be a fraction in 0..1, got 1.5"),
    (["--probe-filler", "-1"], "--probe-filler must be >= 0"),
    (["--budget", "48", "--probe-filler", "600"], "above random:tiny's 512 positions: --probe-filler can be at most"),
    (["--generate", "8", "--recall"], "--recall applies to the teacher-forced eval"),
    (["--repairer", "oracle"], "unknown repairer 'oracle'"),
    # refused before anything runs (here the full-cache reference would run first)
    (["--repairer", "mlm:/nonexistent", "--budget", "48", "--max-tokens", "50", "--no-probe"],
     "masked LM directory '/nonexistent' does not exist"),
])
def test_cli_eval_bad_flags_give_one_line_and_exit_code_2(args, message, capsys):
    assert run_cli("eval", "--model", "random:tiny", *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_an_unusable_out_is_refused_before_the_model_loads(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert run_cli("eval", "--model", "no-such-model", "--out", str(blocker / "results")) == 2
    err = capsys.readouterr().err
    assert "cannot use --out" in err and "no-such-model" not in err


def _fed_streams(monkeypatch) -> list[tuple[list[int], object]]:
    """Every (ids, config) that evaluate feeds through run_stream, in order."""
    fed = []
    original = evaluate_module.run_stream
    monkeypatch.setattr(evaluate_module, "run_stream",
                        lambda lm, ids, config, **kw: fed.append((list(ids), config)) or original(lm, ids, config, **kw))
    return fed


@pytest.mark.parametrize("at,keep,fact_at", [(0.0, 1, 1), (0.0, 4, 4), (0.25, 4, 26), (0.5, 4, 51), (1.0, 4, 101),
                                             (0.02, 8, 8), (0.5, 60, 60)])
def test_the_fact_goes_where_probe_at_says_and_never_into_the_sinks(tiny, at, keep, fact_at):
    text_ids, fact = tiny.encode(TEXT), tiny.encode(PROBE_FACT)
    stream = probe_stream(tiny, text_ids, 100, at, keep=keep)
    assert stream.fact_at == fact_at and stream.fact_end == fact_at + len(fact) and stream.filler == 100
    ids = stream.ids
    assert ids[0] == tiny.bos_id and ids[stream.fact_at:stream.fact_end] == fact
    assert ids[1:stream.fact_at] == text_ids[:fact_at - 1], "the filler before the fact is the text's start"
    after = ids[stream.fact_end:stream.fact_end + 100 - (fact_at - 1)]
    assert after == text_ids[fact_at - 1:100], "then the rest of the filler, nothing lost or doubled"
    assert stream.fact_at >= keep, "no fact token in the rows that are never evicted"
    assert ids[stream.answer_at:] == tiny.encode(PROBE_ANSWER)


def test_evaluate_feeds_the_fact_where_asked_past_the_sinks(tiny, monkeypatch):
    """Through evaluate: --probe-at places the fact, --sinks/--protect push it out of the kept
    rows, and the filler (longer than --max-tokens) comes from the whole text."""
    fed = _fed_streams(monkeypatch)
    text_ids, fact = tiny.encode(TEXT), tiny.encode(PROBE_FACT)
    report = evaluate(tiny, TEXT, policies=["streaming"], budgets=[48], max_tokens=5, probe_filler=120,
                      probe_at=0.5, reference=False)
    probe_ids = fed[-1][0]
    assert probe_ids[61:61 + len(fact)] == fact and probe_ids[1:61] == text_ids[:60]
    assert report.runs[0].probe.fact_at == 61 == report.settings["probe_fact_at"]
    assert report.runs[0].probe.filler == 120 and report.settings["probe_at"] == 0.5
    fed.clear()
    report = evaluate(tiny, TEXT, policies=["streaming"], budgets=[64], max_tokens=5, probe_filler=20, sinks=6,
                      protect=10, reference=False)
    probe_ids = fed[-1][0]
    assert report.runs[0].probe.fact_at == 10, "shifted past max(sinks, protect) rows"
    assert probe_ids[10:10 + len(fact)] == fact and probe_ids[:10] == [tiny.bos_id] + text_ids[:9]
    with pytest.raises(EvalError, match="would land in the first 12 rows"):
        evaluate(tiny, TEXT, policies=["streaming"], budgets=[64], probe_filler=5, sinks=12)


def test_a_filler_past_the_models_positions_or_the_text_is_refused_before_anything_runs(tiny, monkeypatch):
    fed = _fed_streams(monkeypatch)
    fixed = len(probe_stream(tiny, tiny.encode(TEXT), 0).ids)
    longest = tiny.max_positions - fixed
    assert len(probe_stream(tiny, tiny.encode(TEXT), longest).ids) == tiny.max_positions, "the largest that fits"
    with pytest.raises(EvalError, match=f"above random:tiny's 512 positions: --probe-filler can be at most {longest}"):
        evaluate(tiny, TEXT, policies=["streaming"], budgets=[48], max_tokens=20, probe_filler=longest + 1)
    short = TEXT[:200]
    with pytest.raises(EvalError, match="--probe-filler 300 is longer than the text \\(200 tokens\\)"):
        evaluate(tiny, short, policies=["streaming"], budgets=[48], max_tokens=20, probe_filler=300)
    with pytest.raises(EvalError, match="--probe-at must be a fraction"):
        evaluate(tiny, TEXT, policies=["streaming"], budgets=[48], probe_filler=30, probe_at=-0.1)
    assert fed == [], "refused before any run started"
    # the default filler (largest budget + 128) is cut to a short text instead
    report = evaluate(tiny, short, policies=["streaming"], budgets=[48], max_tokens=5, reference=False)
    assert report.runs[0].probe.filler == 176 and report.settings["probe_filler"] == 176
    report = evaluate(tiny, TEXT[:100], policies=["streaming"], budgets=[48], max_tokens=5, reference=False)
    assert report.runs[0].probe.filler == 100


def test_delta_is_the_answer_nll_minus_the_full_caches_in_table_csv_and_json(tiny, tmp_path):
    report = evaluate(tiny, TEXT, policies=["streaming", "h2o"], budgets=[48], max_tokens=5, probe_filler=90,
                      probe_at=0.1)
    full = report.reference.probe
    assert full.nll == pytest.approx(-full.logprob) and full.delta == 0.0
    for run in report.runs:
        probe = run.probe
        assert probe.nll == pytest.approx(-sum(probe.logprobs)) and probe.full_nll == full.nll
        assert probe.delta == pytest.approx(probe.nll - full.nll, abs=1e-9) and abs(probe.delta) > 1e-6
    paths = write_outputs(report, tmp_path)
    rows = {r["policy"]: r for r in csv.DictReader(open(paths["csv"]))}
    for run in report.runs:
        row = rows[run.policy]
        assert float(row["probe_delta_nats"]) == pytest.approx(float(row["probe_nll"]) - float(row["probe_full_nll"]),
                                                               abs=2e-4)
        assert float(row["probe_delta_nats"]) == pytest.approx(run.probe.delta, abs=1e-4)
        assert row["probe_ranks"] == " ".join(map(str, run.probe.ranks)) and row["probe_fact_at"] == "10"
    data = json.loads(paths["json"].read_text())
    for run in data["runs"]:
        assert run["probe"]["delta"] == pytest.approx(run["probe"]["nll"] - data["reference"]["probe"]["nll"])
    cells = {c.header: list(c._cells) for c in table(report).columns}
    assert cells["Δ nats vs full"] == ["+0.00"] + [f"{r.probe.delta:+.2f}" for r in report.runs]
    assert cells["answer NLL"] == [f"{r.probe.nll:.2f}" for r in [report.reference] + report.runs]


def test_the_full_cache_answers_the_probe_even_when_the_text_does_not_fit(tiny):
    report = evaluate(tiny, TEXT, policies=["streaming"], budgets=[48], max_tokens=tiny.max_positions,
                      probe_filler=40, segments=2)
    ref = report.reference
    assert ref.tokens == 0 and ref.nll == [] and math.isnan(ref.ppl) and ref.probe is not None
    assert report.runs[0].probe.delta == pytest.approx(report.runs[0].probe.nll - ref.probe.nll)
    assert report.runs[0].ratio is None


def test_recall_adds_a_plus_recall_run_of_every_bounded_policy(tiny, monkeypatch, tmp_path):
    fed = _fed_streams(monkeypatch)
    report = evaluate(tiny, TEXT, policies=["streaming", "none"], budgets=[48, 56], max_tokens=5, probe_filler=5,
                      recall=True, reference=False)
    assert [r.label for r in report.runs] == ["streaming@48", "streaming+recall@48", "none@48",
                                              "streaming@56", "streaming+recall@56", "none@56"]
    assert [r.recall for r in report.runs] == [False, True, False] * 2 and report.settings["recall"] is True
    assert [config.recall for _, config in fed] == [r.recall for r in report.runs for _ in range(2)], \
        "the +recall runs (text and probe) ran with BrainConfig.recall on, the others with it off"
    rows = list(csv.DictReader(open(write_outputs(report, tmp_path)["csv"])))
    assert [(r["policy"], r["recall"]) for r in rows[:3]] == [("streaming", "False"), ("streaming+recall", "True"),
                                                               ("none", "False")]
    assert "streaming+recall" in table(report).columns[0]._cells
    assert make_config("h2o", 48, recall=True).recall and not make_config("h2o", 48).recall
    plain = evaluate(tiny, TEXT, policies=["streaming"], budgets=[48], max_tokens=5, probe=False, reference=False)
    assert [r.label for r in plain.runs] == ["streaming@48"]


def test_cli_eval_recall_and_probe_at(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "res"
    assert run_cli("eval", "--model", "random:tiny", "--text", str(text), "--budget", "48", "--policy", "h2o",
                   "--max-tokens", "5", "--probe-filler", "40", "--probe-at", "0.5", "--recall", "--out", str(out)) == 0
    assert "h2o+recall" in capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert [run["label"] for run in data["runs"]] == ["h2o@48", "h2o+recall@48"]
    assert data["settings"]["probe_at"] == 0.5 and data["runs"][1]["probe"]["fact_at"] == 21
