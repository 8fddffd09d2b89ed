"""`positronic eval`: teacher-forced perplexity through a bounded cache, the probe, the outputs."""

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F

from positronic.evaluate import (DEFAULT_TEXT, PROBE_ANSWER, EvalError, evaluate, make_config, moving_average,
                                 probe_stream, reference_config, run_stream, segment_bounds, table, write_outputs)
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
    ids, answer_at = probe_stream(tiny, text_ids, 70)
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
    assert "h2o" in stdout and "full" in stdout and "probe logp" in stdout
    data = json.loads((out / "results.json").read_text())
    assert [run["label"] for run in data["runs"]] == ["h2o@48", "h2o@56"] and data["reference"]["label"] == "none@full"
    assert {p.name for p in out.iterdir()} == {"results.csv", "results.json", "nll_by_position.png"}
    assert DEFAULT_TEXT.is_file()


@pytest.mark.parametrize("args,message", [
    (["--policy", "lru"], "unknown policy 'lru'"),
    (["--text", "/nonexistent/x.txt"], "cannot read --text /nonexistent/x.txt"),
    (["--budget", "20"], "budget 20"),
    (["--max-tokens", "1"], "--max-tokens must be >= 2"),
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
