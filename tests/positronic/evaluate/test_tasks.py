"""Retrieval tasks (positronic/evaluate/tasks.py, `eval --task`): generated from a seed, their
answers what a reader of the context finds, scored exactly, through the CLI."""

from __future__ import annotations

import json
import re

import pytest

from positronic.evaluate import DEFAULT_TEXT
from positronic.evaluate.stream import EvalError, make_config, reference_config
from positronic.evaluate.tasks import TASKS, answers_exactly, make_instances, task_table, TaskRow

FILLER = DEFAULT_TEXT.read_text(encoding="utf-8")


def read_answer(task: str, context: str, question: str) -> str:
    """The answer a reader finds in the context, by the task's rule (no code of the generator)."""
    if task in ("needle", "multikey"):
        key = re.search(r"magic number for (\w+)\?", question).group(1)
        return re.findall(rf"The special magic number for {key} is (\d+)\.", context)[0]
    if task == "multivalue":
        key = re.search(r"magic numbers for (\w+)\?", question).group(1)
        first, second, third = re.findall(rf"One of the special magic numbers for {key} is (\d+)\.", context)
        return f"{first}, {second} and {third}"
    if task == "variables":
        values = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", context))
        name = re.search(r"value of VAR (\w+)\?", question).group(1)
        while not values[name].isdigit():
            name = values[name].removeprefix("VAR ")
        return values[name]
    name = re.search(r"What is (\w+)'s favourite colour", question).group(1)
    return re.findall(rf"{name}'s favourite colour is (\w+)\.", context)[0]


@pytest.mark.parametrize("task", TASKS)
def test_instances_are_the_same_for_a_seed_and_their_answer_is_what_the_context_says(tiny, task):
    made = make_instances(tiny, task, FILLER, context=300, count=5, seed=3)
    assert made == make_instances(tiny, task, FILLER, context=300, count=5, seed=3)
    assert made != make_instances(tiny, task, FILLER, context=300, count=5, seed=4)
    for instance in made:
        ids = instance.ids
        assert ids[0] == tiny.bos_id and instance.question_at < instance.answer_at < len(ids)
        assert 150 <= instance.question_at <= 330, "about the context asked for (pieces counted apart)"
        context, question = tiny.decode(ids[1:instance.question_at]), tiny.decode(ids[instance.question_at:instance.answer_at])
        assert read_answer(task, context, question) == instance.answer
        assert tiny.decode(ids[instance.answer_at:]).strip() == instance.answer


def test_bad_task_settings_are_refused_by_name(tiny):
    with pytest.raises(EvalError, match="unknown task 'haystack'"):
        make_instances(tiny, "haystack", FILLER, context=300, count=2)
    with pytest.raises(EvalError, match="at least one instance and a context of at least 64"):
        make_instances(tiny, "needle", FILLER, context=300, count=0)
    with pytest.raises(EvalError, match="no sentences"):
        make_instances(tiny, "needle", "word", context=300, count=1)
    with pytest.raises(EvalError, match="positions: give a smaller --context"):
        make_instances(tiny, "needle", FILLER, context=tiny.max_positions, count=1)


def test_an_answer_counts_only_when_every_token_is_the_most_likely(tiny):
    """Exact match is greedy's: the random model answers nothing of a needle, and an instance
    whose answer is what the model predicts anyway (made so) counts."""
    instance = make_instances(tiny, "needle", FILLER, context=200, count=1)[0]
    assert not answers_exactly(tiny, instance, reference_config(len(instance.ids)))
    from positronic.brain.loop import Brain

    brain = Brain.start(tiny, instance.ids[:instance.answer_at], reference_config(len(instance.ids) + 8))
    predicted = []
    for _ in range(3):
        token = int(brain.state.next_logits.argmax())
        predicted.append(token)
        brain.step(force=token)
    made = type(instance)("needle", instance.ids[:instance.answer_at] + predicted, instance.question_at,
                          instance.answer_at, "", 0.1)
    assert answers_exactly(tiny, made, reference_config(len(made.ids)))
    assert answers_exactly(tiny, made, make_config("streaming", 64)) in (True, False)  # runs pruned


def test_the_table_sums_each_cache(tmp_path):
    rows = [TaskRow("needle", "full", None, 3, 4), TaskRow("needle", "h2o@64", 64, 1, 4),
            TaskRow("recall", "full", None, 4, 4), TaskRow("recall", "h2o@64", 64, 2, 4)]
    table = task_table(rows)
    assert "| needle | 3/4 | 1/4 |" in table and "**7/8** (88%)" in table and "**3/8** (38%)" in table
    low, high = rows[0].interval()
    assert 0.3 < low < 0.75 < high < 1.0


def test_eval_task_runs_end_to_end_and_refuses_unread_options(tmp_path, capsys, run_cli):
    out = tmp_path / "res"
    assert run_cli("eval", "--model", "random:tiny", "--task", "needle", "--task", "recall", "--context", "128",
                   "--instances", "2", "--budget", "64", "--policy", "streaming", "--policy", "h2o",
                   "--out", str(out)) == 0
    data = json.loads((out / "tasks.json").read_text())
    assert [(r["task"], r["run"], r["total"]) for r in data["rows"]] == [
        (task, run, 2) for task in ("needle", "recall") for run in ("full", "streaming@64", "h2o@64")]
    assert data["context"] == 128 and data["tasks"] == ["needle", "recall"]
    assert "| needle |" in capsys.readouterr().out
    for args, message in ((["--task", "hay"], "--task 'hay' is not a task"),
                          (["--task", "needle", "--max-tokens", "64"], "--max-tokens applies to the teacher-forced eval"),
                          (["--context", "128"], "--context applies to --task"),
                          (["--task", "needle", "--generate", "8"], "--task and --generate are two modes"),
                          (["--task", "needle", "--instances", "0"], "--instances must be >= 1")):
        assert run_cli("eval", "--model", "random:tiny", "--out", str(out), *args) == 2, args
        assert message in capsys.readouterr().err, args


@pytest.mark.slow
@pytest.mark.smollm2
def test_the_embedded_model_with_its_full_cache_finds_a_needle_and_a_stated_fact(smol):
    """The reference reader: on short instances the full cache answers the needle and the
    recall tasks exactly (what makes a policy's misses its own)."""
    for task in ("needle", "recall"):
        for instance in make_instances(smol, task, FILLER, context=256, count=2, seed=1):
            assert answers_exactly(smol, instance, reference_config(len(instance.ids))), (task, instance.answer)


@pytest.mark.slow
@pytest.mark.smollm2
def test_the_default_still_finds_a_needle_stated_early_in_a_prompt_six_times_its_budget(smol):
    """SmartKV with recall (the embedded model's default) at a 512-row budget, a needle at 10%
    of a ~2,950-token prompt: the prompt is pruned to the budget before the question comes, so
    the number comes back only through recall's index. With the index's 4,096 tokens it does,
    and the question is answered exactly; with 2,048 (the index before 2026-12-04) the fact had
    already been overwritten and this fails (checked by setting SmartKVPolicy.recall_capacity)."""
    from positronic.brain.defaults import default_policy

    choice = default_policy("smollm2", make_config("smartkv", 512), recall=None)
    assert (choice.policy, choice.recall) == ("smartkv", True)
    config = make_config("smartkv", 512, recall=True, memory_rank="recent", gates=choice.gates)
    instance = make_instances(smol, "needle", FILLER, context=3100, count=1, seed=0)[0]
    # the fact (about token 320) left the window more than 2,048 window-leavers before the question
    assert instance.depth == 0.1 and instance.question_at > 2048 + 512 + 330
    assert answers_exactly(smol, instance, config)
