"""positronic.evaluate.probe: the probe stream's layout and its scores against a plain forward."""


import pytest
import torch

from positronic.evaluate import PROBE_ANSWER, PROBE_FACT, EvalError, evaluate, probe_stream


def test_probe_scores_the_answer_tokens_as_a_plain_forward_does(tiny, eval_text):
    text_ids = tiny.encode(eval_text)
    report = evaluate(tiny, eval_text, policies=["streaming"], budgets=[48], max_tokens=60, probe_filler=70)
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


@pytest.mark.parametrize("at,keep,fact_at", [(0.0, 1, 1), (0.0, 4, 4), (0.25, 4, 26), (0.5, 4, 51), (1.0, 4, 101),
                                             (0.02, 8, 8), (0.5, 60, 60)])
def test_the_fact_goes_where_probe_at_says_and_never_into_the_sinks(tiny, at, keep, fact_at, eval_text):
    text_ids, fact = tiny.encode(eval_text), tiny.encode(PROBE_FACT)
    stream = probe_stream(tiny, text_ids, 100, at, keep=keep)
    assert stream.fact_at == fact_at and stream.fact_end == fact_at + len(fact) and stream.filler == 100
    ids = stream.ids
    assert ids[0] == tiny.bos_id and ids[stream.fact_at:stream.fact_end] == fact
    assert ids[1:stream.fact_at] == text_ids[:fact_at - 1], "the filler before the fact is the text's start"
    after = ids[stream.fact_end:stream.fact_end + 100 - (fact_at - 1)]
    assert after == text_ids[fact_at - 1:100], "then the rest of the filler, nothing lost or doubled"
    assert stream.fact_at >= keep, "no fact token in the rows that are never evicted"
    assert ids[stream.answer_at:] == tiny.encode(PROBE_ANSWER)


def test_evaluate_feeds_the_fact_where_asked_past_the_sinks(tiny, eval_text, fed_streams):
    """Through evaluate: --probe-at places the fact, --sinks/--protect push it out of the kept
    rows, and the filler (longer than --max-tokens) comes from the whole text."""
    fed = fed_streams
    text_ids, fact = tiny.encode(eval_text), tiny.encode(PROBE_FACT)
    report = evaluate(tiny, eval_text, policies=["streaming"], budgets=[48], max_tokens=5, probe_filler=120,
                      probe_at=0.5, reference=False)
    probe_ids = fed[-1][0]
    assert probe_ids[61:61 + len(fact)] == fact and probe_ids[1:61] == text_ids[:60]
    assert report.runs[0].probe.fact_at == 61 == report.settings["probe_fact_at"]
    assert report.runs[0].probe.filler == 120 and report.settings["probe_at"] == 0.5
    fed.clear()
    report = evaluate(tiny, eval_text, policies=["streaming"], budgets=[64], max_tokens=5, probe_filler=20, sinks=6,
                      protect=10, reference=False)
    probe_ids = fed[-1][0]
    assert report.runs[0].probe.fact_at == 10, "shifted past max(sinks, protect) rows"
    assert probe_ids[10:10 + len(fact)] == fact and probe_ids[:10] == [tiny.bos_id] + text_ids[:9]
    with pytest.raises(EvalError, match="would land in the first 12 rows"):
        evaluate(tiny, eval_text, policies=["streaming"], budgets=[64], probe_filler=5, sinks=12)


def test_a_filler_past_the_models_positions_or_the_text_is_refused_before_anything_runs(tiny, eval_text, fed_streams):
    fed = fed_streams
    fixed = len(probe_stream(tiny, tiny.encode(eval_text), 0).ids)
    longest = tiny.max_positions - fixed
    assert len(probe_stream(tiny, tiny.encode(eval_text), longest).ids) == tiny.max_positions, "the largest that fits"
    with pytest.raises(EvalError, match=f"above random:tiny's 512 positions: --probe-filler can be at most {longest}"):
        evaluate(tiny, eval_text, policies=["streaming"], budgets=[48], max_tokens=20, probe_filler=longest + 1)
    short = eval_text[:200]
    with pytest.raises(EvalError, match="--probe-filler 300 is longer than the text \\(200 tokens\\)"):
        evaluate(tiny, short, policies=["streaming"], budgets=[48], max_tokens=20, probe_filler=300)
    with pytest.raises(EvalError, match="--probe-at must be a fraction"):
        evaluate(tiny, eval_text, policies=["streaming"], budgets=[48], probe_filler=30, probe_at=-0.1)
    assert fed == [], "refused before any run started"
    # the default filler (largest budget + 128) is cut to a short text instead
    report = evaluate(tiny, short, policies=["streaming"], budgets=[48], max_tokens=5, reference=False)
    assert report.runs[0].probe.filler == 176 and report.settings["probe_filler"] == 176
    report = evaluate(tiny, eval_text[:100], policies=["streaming"], budgets=[48], max_tokens=5, reference=False)
    assert report.runs[0].probe.filler == 100
