"""`positronic eval --generate N`: free generation per policy and budget, re-scored with the full history."""

import csv
import json
import math

import pytest
import torch

from positronic.evaluate import EvalError, make_config
from positronic.evaluate.generation import (CSV_COLUMNS, distinct_n, evaluate_generation, generate_run, prompt_of,
                                        rescore, table, write_generation_outputs)
from positronic.evaluate.generation import main as generation_main
from positronic.brain.loop import Brain
from positronic.models import with_cache

def stepwise_nll(lm, ids: list[int], first: int) -> list[float]:
    """NLL of ids[first:], feeding one token at a time into a DynamicCache (independent of
    `rescore`'s chunked forward): the plain model with its whole history."""
    from transformers import DynamicCache

    cache, nll = DynamicCache(), []
    with torch.inference_mode():
        for i in range(len(ids) - 1):
            logits = lm.model(input_ids=torch.tensor([[ids[i]]]), position_ids=torch.tensor([[i]]),
                              **with_cache(cache), use_cache=True).logits[0, -1].float()
            if i + 1 >= first:
                nll.append(-float(torch.log_softmax(logits, dim=-1)[ids[i + 1]]))
    return nll


def test_distinct_n_counts_repeated_ngrams():
    assert distinct_n([1, 2, 3, 4, 5, 6], 4) == 1.0
    # 1234 2341 3412 4123 1234 2341: 4 distinct of 6
    assert distinct_n([1, 2, 3, 4, 1, 2, 3, 4, 1], 4) == pytest.approx(4 / 6)
    assert distinct_n([7] * 10, 4) == pytest.approx(1 / 7)
    assert distinct_n([1, 2, 1], 1) == pytest.approx(2 / 3)
    assert distinct_n("a b c a b c".split(), 2) == pytest.approx(3 / 5)
    assert distinct_n([1, 2, 3], 4) is None, "no 4-gram at all"
    with pytest.raises(ValueError):
        distinct_n([1, 2], 0)


def test_rescore_is_the_plain_models_nll_with_the_full_history(tiny):
    gen = torch.Generator().manual_seed(1)
    prompt = [tiny.bos_id] + tiny.encode("The sea at night")
    generated = torch.randint(3, tiny.vocab_size, (25,), generator=gen).tolist()
    expected = stepwise_nll(tiny, prompt + generated, len(prompt))
    assert len(expected) == 25
    for chunk in (512, 7, 1):  # one forward, and chunks that split the prompt and the generated tokens
        got = rescore(tiny, prompt, generated, chunk=chunk)
        assert got == pytest.approx(expected, abs=1e-4), f"chunk {chunk}"
    # the history matters: the same tokens after another prompt score differently
    other = rescore(tiny, [tiny.bos_id] + tiny.encode("A dry desert"), generated)
    assert other != pytest.approx(expected, abs=1e-3)
    assert rescore(tiny, prompt, []) == []


def test_generation_samples_through_brain_step_and_a_seed_repeats_it(tiny, monkeypatch, eval_text):
    forced = []
    original = Brain.step
    monkeypatch.setattr(Brain, "step", lambda self, force=None: forced.append(force) or original(self, force))
    prompt = prompt_of(tiny, eval_text, 16)
    assert prompt[0] == tiny.bos_id and prompt[1:] == tiny.encode(eval_text)[:16]
    config = make_config("streaming", 48)
    first = generate_run(tiny, prompt, config, 40)
    assert forced == [None] * 40, "every token is sampled by an unforced tick"
    again = generate_run(tiny, prompt, config, 40)
    assert first.ids == again.ids and first.tokens == 40 and first.text == tiny.decode(first.ids)
    assert first.deletes > 0, "40 tokens after a 17-token prompt overflow a budget of 48"
    config.seed = 1
    assert generate_run(tiny, prompt, config, 40).ids != first.ids, "the seed drives the sampler"


@pytest.mark.parametrize("policy", ["streaming", "brightness"])
def test_a_budget_that_forces_eviction_keeps_the_live_length_within_it(tiny, policy, eval_text):
    prompt = prompt_of(tiny, eval_text, 16)
    run = generate_run(tiny, prompt, make_config(policy, 48, sinks=4), 50)
    assert run.tokens == 50 and not run.stopped and run.error is None
    assert run.deletes + run.repairs > 0, "17 + 50 tokens cannot fit in 48 rows without evicting"
    assert 40 <= run.max_live <= 48


def test_report_reference_ratios_and_output_files(tiny, tmp_path, eval_text):
    report = evaluate_generation(tiny, eval_text, policies=["streaming"], budgets=[48, 64], generate=40, prompt_tokens=16,
                                 seed=3, text_name="keeper")
    ref, tight, roomy = report.reference, *report.runs
    assert ref is not None and ref.label == "none@full" and report.note is None
    assert [r.label for r in report.runs] == ["streaming@48", "streaming@64"]
    assert ref.max_live == 17 + 40 and tight.max_live <= 48
    # 17 + 40 rows fit a budget of 64: nothing is evicted, so the same seed gives the reference's tokens
    assert roomy.deletes == 0 and roomy.ids == ref.ids and roomy.ratio == pytest.approx(1.0)
    for run in (ref, tight, roomy):
        assert run.tokens == 40 and len(run.nll) == 40
        assert run.nll == pytest.approx(rescore(tiny, report.prompt_ids, run.ids), abs=1e-5)
        assert run.ppl == pytest.approx(math.exp(sum(run.nll) / 40))
        assert run.distinct4 == distinct_n(run.ids, 4)
    assert tight.ratio == pytest.approx(tight.ppl / ref.ppl)
    reseeded = make_config("streaming", 64)
    reseeded.seed = 3
    assert generate_run(tiny, report.prompt_ids, reseeded, 40).ids == roomy.ids, "every run samples with seed 3"
    assert report.settings["seed"] == 3 and report.settings["temperature"] == 0.7 and report.settings["top_k"] == 50

    paths = write_generation_outputs(report, tmp_path / "out")
    rows = list(csv.DictReader(open(paths["csv"], encoding="utf-8")))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [r["run"] for r in rows] == ["none@full", "streaming@48", "streaming@64"]
    assert float(rows[1]["rescored_ppl"]) == pytest.approx(tight.ppl, rel=1e-4) and rows[1]["tokens"] == "40"
    data = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert data["settings"]["generate"] == 40 and data["settings"]["prompt_text"] == tiny.decode(report.prompt_ids[1:])
    assert data["settings"]["prompt_ids"] == report.prompt_ids and data["reference"]["label"] == "none@full"
    assert data["runs"][0]["ids"] == tight.ids and len(data["runs"][0]["nll"]) == 40
    assert data["runs"][0]["text"] == tight.text
    texts = sorted(p.name for p in paths["texts"].iterdir())
    assert texts == ["none@full.txt", "streaming@48.txt", "streaming@64.txt"]
    assert (paths["texts"] / "streaming@48.txt").read_bytes().decode("utf-8") == tight.text
    md = paths["md"].read_text(encoding="utf-8")
    assert md.index("## Prompt") < md.index("## none@full") < md.index("## streaming@48") < md.index("## streaming@64")
    assert report.prompt_text in md
    cells = [list(c._cells) for c in table(report).columns]
    assert [c.header for c in table(report).columns] == ["run", "tokens", "rescored ppl", "×full", "distinct-4", "tok/s"]
    assert cells[0] == ["none@full", "streaming@48", "streaming@64"] and cells[3][0] == "1.000"


def test_none_with_stop_ends_early_and_says_how_many_tokens(tiny, tmp_path, eval_text):
    report = evaluate_generation(tiny, eval_text, policies=["none"], budgets=[48], generate=60, prompt_tokens=16,
                                 at_capacity="stop", reference=False)
    run = report.runs[0]
    assert run.stopped and run.tokens == 48 - 17 and run.max_live == 48 and len(run.nll) == 31
    assert report.reference is None and run.ratio is None
    rows = list(csv.DictReader(open(write_generation_outputs(report, tmp_path)["csv"], encoding="utf-8")))
    assert rows[0]["tokens"] == "31" and rows[0]["requested"] == "60" and rows[0]["stopped"] == "True"
    assert list(table(report).columns[1]._cells) == ["31 (stopped)"]


def test_a_failed_tick_is_retried_once_and_a_second_failure_ends_that_run(tiny, monkeypatch, eval_text):
    brains = []
    start = Brain.start
    monkeypatch.setattr(Brain, "start", lambda lm, *args, **kwargs: brains.append(start(lm, *args, **kwargs))
                        or brains[-1])

    def fault_after(count):
        def on_token(i):
            if i == count:
                brains[-1].state.inject_fault("forward")
        return on_token

    prompt = prompt_of(tiny, eval_text, 16)
    config = make_config("streaming", 48)
    run = generate_run(tiny, prompt, config, 30, on_token=fault_after(10))
    assert run.rebuilds == 1 and run.tokens == 30 and run.error is None
    assert brains[-1].state.live_token_ids() == prompt + run.ids, "the failed tick added nothing, the retry one token"

    original = Brain.step

    def fail_again(self, force=None):  # once a tick failed, its retry fails as well
        record = original(self, force)
        if record.rebuilt:
            self.state.inject_fault("forward")
        return record

    monkeypatch.setattr(Brain, "step", fail_again)
    run = generate_run(tiny, prompt, config, 30, on_token=fault_after(10))
    assert run.tokens == 10 and run.error is not None and "failed twice" in run.error
    assert list(table_of(tiny, run).columns[1]._cells) == ["10 (failed)"]


def table_of(lm, run):
    from positronic.evaluate.generation import GenerationReport

    return table(GenerationReport(lm.name, "t", [lm.bos_id], "", {"generate": run.requested, "seed": 0}, [run], None))


def test_the_reference_is_skipped_with_a_note_when_it_exceeds_the_positions(tiny, eval_text):
    long_text = eval_text * 4
    assert len(tiny.encode(long_text)) >= 490
    report = evaluate_generation(tiny, long_text, policies=["streaming"], budgets=[48], generate=30,
                                 prompt_tokens=490)
    assert report.reference is None and "above random:tiny's 512 positions" in report.note
    assert report.runs[0].tokens == 30 and report.runs[0].ratio is None and len(report.runs[0].nll) == 30
    assert report.note in str(table(report).caption)


@pytest.mark.parametrize("kwargs,message", [
    (dict(generate=0), "--generate must be >= 1, got 0"),
    (dict(generate=5, prompt_tokens=0), "--prompt-tokens must be >= 1"),
    (dict(generate=5, policies=["lru"]), "unknown policy 'lru'"),
    (dict(generate=5, budgets=[20]), "budget 20"),
    (dict(generate=5, budgets=[600]), "budget 600 is above random:tiny's 512 positions"),
    (dict(generate=5, prompt_tokens=600), "--prompt-tokens 600"),
    (dict(generate=5, prompt_tokens=100, body="Too short."), "the text has 10 tokens, fewer than --prompt-tokens 100"),
])
def test_bad_options_raise_eval_error_and_write_nothing(tmp_path, kwargs, message, eval_text):
    text = tmp_path / "t.txt"
    settings = dict(policies=["streaming"], budgets=[48]) | kwargs
    text.write_text(settings.pop("body", eval_text))
    out = tmp_path / "out"
    with pytest.raises(EvalError, match=message.replace("(", r"\(")):
        generation_main(model="random:tiny", text=text, out=out, device="cpu", **settings)
    assert not out.exists()


def test_cli_bad_generate_gives_one_line_exit_2_and_writes_nothing(tmp_path, capsys, run_cli):
    out = tmp_path / "out"
    assert run_cli("eval", "--model", "random:tiny", "--generate", "0", "--out", str(out)) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --generate must be >= 1, got 0" and not out.exists()


@pytest.mark.smollm2
def test_cli_generate_on_the_embedded_model_writes_files_and_prints_the_table(tmp_path, capsys, run_cli):
    out = tmp_path / "gen"
    assert run_cli("eval", "--model", "smollm2", "--device", "cpu", "--generate", "20", "--prompt-tokens", "32",
                   "--budget", "48", "--policy", "streaming", "--policy", "brightness", "--out", str(out)) == 0
    stdout = capsys.readouterr().out
    for word in ("rescored ppl", "distinct-4", "none@full", "streaming@48", "brightness@48"):
        assert word in stdout
    assert {p.name for p in out.iterdir()} == {"generation.csv", "generation.json", "texts", "side_by_side.md"}, \
        "generation mode only: no teacher-forced results"
    data = json.loads((out / "generation.json").read_text(encoding="utf-8"))
    assert data["model"] == "smollm2" and data["settings"]["generate"] == 20 and data["settings"]["seed"] == 0
    assert data["settings"]["prompt_text"].startswith("Alice") or "Alice" in data["settings"]["prompt_text"]
    assert len(data["settings"]["prompt_ids"]) == 33
    assert [r["label"] for r in data["runs"]] == ["streaming@48", "brightness@48"]
    for run in [data["reference"], *data["runs"]]:
        assert run["tokens"] == 20 and len(run["ids"]) == 20 and len(run["nll"]) == 20
        assert 1 < run["ppl"] < 1000, "a real model finds its own text likely"
        assert run["max_live"] <= (48 if run["budget"] else 53)
    rows = list(csv.DictReader(open(out / "generation.csv", encoding="utf-8")))
    assert [r["run"] for r in rows] == ["none@full", "streaming@48", "brightness@48"]
    assert sorted(p.name for p in (out / "texts").iterdir()) == ["brightness@48.txt", "none@full.txt",
                                                                 "streaming@48.txt"]
    md = (out / "side_by_side.md").read_text(encoding="utf-8")
    assert data["runs"][1]["text"] in md and data["settings"]["prompt_text"] in md
