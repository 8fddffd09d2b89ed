"""positronic.evaluate.sweep: every (policy, budget) and the full-cache reference, against a
plain forward; settings refused; recall runs."""

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F

from positronic.evaluate import EvalError, evaluate, make_config, reference_config, table, write_outputs


def plain_nll(lm, ids: list[int]) -> torch.Tensor:
    """Per-token NLL of ids[1:] from one plain forward over the whole sequence."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids])).logits[0].float()
    return F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")


def test_full_cache_perplexity_equals_the_plain_models(tiny, eval_text):
    ids = [tiny.bos_id] + tiny.encode(eval_text)[:120]
    report = evaluate(tiny, eval_text, policies=["none"], budgets=[200], max_tokens=120, probe=False)
    expected = plain_nll(tiny, ids)
    for run in (report.reference, report.runs[0]):
        assert run.tokens == 120
        assert torch.allclose(torch.tensor(run.nll), expected, atol=1e-4, rtol=0), run.label
        assert run.ppl == pytest.approx(math.exp(expected.mean().item()), rel=1e-4)
    assert report.runs[0].ratio == pytest.approx(1.0, abs=1e-6)


def test_a_short_stream_still_has_its_full_cache_reference(tiny, eval_text):
    """The reference's budget is the stream's length + 1, which may be below what a culling
    run needs; it never culls, so it must still run (and match the plain model)."""
    report = evaluate(tiny, eval_text, policies=["streaming"], budgets=[48], max_tokens=10, probe=False)
    ids = [tiny.bos_id] + tiny.encode(eval_text)[:10]
    assert report.reference is not None and report.reference.tokens == 10
    assert torch.allclose(torch.tensor(report.reference.nll), plain_nll(tiny, ids), atol=1e-4, rtol=0)
    assert report.runs[0].ratio == pytest.approx(1.0, abs=1e-5), "10 tokens never fill a budget of 48"
    config = reference_config(3, sinks=8, protect=20)
    config.validate()
    assert config.budget >= 4 and config.policy == "none" and config.at_capacity == "stop"


def test_every_policy_runs_end_to_end_and_writes_csv_json_png(tiny, tmp_path, eval_text):
    report = evaluate(tiny, eval_text, policies=["brightness", "streaming", "scored", "h2o", "none"], budgets=[48],
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


def test_brightness_cull_only_evicts_by_deleting(tiny, eval_text):
    report = evaluate(tiny, eval_text, policies=["brightness"], budgets=[48], max_tokens=72, probe=False,
                      repairer="none")
    run = report.runs[0]
    assert run.repairs == 0 and run.deletes > 0 and run.max_live <= 49
    assert report.settings["repairer"] == "none"
    with pytest.raises(EvalError, match="unknown repairer 'oracle'"):
        evaluate(tiny, eval_text, policies=["brightness"], budgets=[48], repairer="oracle")


def test_none_with_stop_scores_only_what_fit(tiny, eval_text):
    report = evaluate(tiny, eval_text, policies=["none"], budgets=[48], max_tokens=100, at_capacity="stop", probe=False)
    run = report.runs[0]
    assert run.stopped_at == 47 and run.tokens == 47 and run.segments[-1] is None
    assert run.ratio == pytest.approx(1.0, abs=1e-5), "nothing was evicted before it stopped"


def test_bad_settings_are_refused(tiny, eval_text):
    with pytest.raises(EvalError, match="unknown policy"):
        evaluate(tiny, eval_text, policies=["lru"], budgets=[48])
    with pytest.raises(EvalError, match="budget"):
        evaluate(tiny, eval_text, policies=["streaming"], budgets=[20])


def test_the_full_cache_answers_the_probe_even_when_the_text_does_not_fit(tiny, eval_text):
    report = evaluate(tiny, eval_text, policies=["streaming"], budgets=[48], max_tokens=tiny.max_positions,
                      probe_filler=40, segments=2)
    ref = report.reference
    assert ref.tokens == 0 and ref.nll == [] and math.isnan(ref.ppl) and ref.probe is not None
    assert report.runs[0].probe.delta == pytest.approx(report.runs[0].probe.nll - ref.probe.nll)
    assert report.runs[0].ratio is None


def test_recall_adds_a_plus_recall_run_of_every_bounded_policy(tiny, tmp_path, eval_text, fed_streams):
    fed = fed_streams
    report = evaluate(tiny, eval_text, policies=["streaming", "none"], budgets=[48, 56], max_tokens=5, probe_filler=5,
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
    plain = evaluate(tiny, eval_text, policies=["streaming"], budgets=[48], max_tokens=5, probe=False, reference=False)
    assert [r.label for r in plain.runs] == ["streaming@48"]
