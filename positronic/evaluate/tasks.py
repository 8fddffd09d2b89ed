"""Retrieval tasks in the manner of RULER, generated locally from a seed: does a bounded cache
still hold what a question asks about?

    instances = make_instances(lm, "needle", filler_text, context=2048, count=8, seed=0)
    exact = [answers_exactly(lm, instance, config) for instance in instances]

Each instance is BOS, a haystack (sentences of a filler text) with the task's facts put in at
chosen depths, a question, and its answer. The context (everything before the question) is
the prompt: a brain starts on it, so a context past the budget is pruned to it at once, before
the question is known (Brain.start: the policy's bulk prune from the newest row's attention,
as the server treats a long prompt); the question is then read a token per tick and the answer
teacher-forced after it. An instance is answered exactly when every answer token is the most
likely next token (what greedy decoding would write, token for token).

Tasks (TASKS):
    needle      one key's number, at one of five depths (10%..90%)
    multikey    four keys' numbers, one asked (the others are distractors)
    multivalue  three numbers for one key, all asked, in the order they came
    variables   a value passed along a chain of three assignments, the last one asked
    recall      a fact stated early (a person's colour, at 5-15% depth), asked at the end
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace

import torch

from ..brain.config import AUTO_GATES
from ..brain.loop import Brain, BrainConfig
from .stream import EvalError

KEYS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
        "lagoon", "marble", "nectar", "obsidian", "pepper", "quartz", "raven", "saffron", "tundra", "umber",
        "velvet", "willow", "yarrow", "zephyr")
NAMES = ("Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas")
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "black", "white", "silver", "brown")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
TASKS = ("needle", "multikey", "multivalue", "variables", "recall")


@dataclass(frozen=True)
class Instance:
    """ids: BOS, the context, the question, the answer; `question_at` / `answer_at`: where the
    question and the answer start in `ids`."""

    task: str
    ids: list[int]
    question_at: int
    answer_at: int
    answer: str
    depth: float  # where the (first) fact sits in the haystack, as a fraction


def _number(rng: random.Random) -> str:
    return str(rng.randrange(10000, 100000))


def _facts(task: str, rng: random.Random, index: int) -> tuple[list[tuple[float, str]], str, str]:
    """([(depth, fact sentence)], question, answer) of instance `index` of `task`."""
    if task == "needle":
        key, value = rng.choice(KEYS), _number(rng)
        return ([(DEPTHS[index % len(DEPTHS)], f"The special magic number for {key} is {value}.")],
                f"What is the special magic number for {key}? Answer: The special magic number for {key} is",
                f" {value}")
    if task == "multikey":
        keys, values = rng.sample(KEYS, 4), [_number(rng) for _ in range(4)]
        depths = sorted(rng.uniform(0.05, 0.95) for _ in range(4))
        asked = rng.randrange(4)
        return ([(d, f"The special magic number for {k} is {v}.") for d, k, v in zip(depths, keys, values)],
                f"What is the special magic number for {keys[asked]}? Answer: The special magic number for "
                f"{keys[asked]} is", f" {values[asked]}")
    if task == "multivalue":
        key, values = rng.choice(KEYS), [_number(rng) for _ in range(3)]
        depths = sorted(rng.uniform(0.05, 0.95) for _ in range(3))
        return ([(d, f"One of the special magic numbers for {key} is {v}.") for d, v in zip(depths, values)],
                f"What are all the special magic numbers for {key}? Answer: The special magic numbers for {key} are",
                f" {values[0]}, {values[1]} and {values[2]}")
    if task == "variables":
        names, value = rng.sample([k.upper() for k in KEYS], 3), _number(rng)
        depths = sorted(rng.uniform(0.05, 0.95) for _ in range(3))
        chain = [f"VAR {names[0]} = {value}.", f"VAR {names[1]} = VAR {names[0]}.", f"VAR {names[2]} = VAR {names[1]}."]
        return (list(zip(depths, chain)), f"What is the value of VAR {names[2]}? Answer: VAR {names[2]} =", f" {value}")
    if task == "recall":
        name, colour = rng.choice(NAMES), rng.choice(COLOURS)
        return ([(rng.uniform(0.05, 0.15), f"{name}'s favourite colour is {colour}.")],
                f"What is {name}'s favourite colour? Answer: {name}'s favourite colour is", f" {colour}")
    raise EvalError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def make_instances(lm, task: str, filler: str, *, context: int, count: int, seed: int = 0) -> list[Instance]:
    """`count` instances of `task` with contexts of up to about `context` tokens (BOS, haystack
    and facts, less than a sentence short of it; the question and answer come after), the same
    for a seed. EvalError for an unknown
    task, a filler without sentences, or a stream past the model's positions."""
    if task not in TASKS:
        raise EvalError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if count < 1 or context < 64:
        raise EvalError(f"a task needs at least one instance and a context of at least 64 tokens, got {count} and "
                        f"{context}")
    sentences = []
    for sentence in re.split(r"(?<=[.!?])\s+", " ".join(filler.split())):
        words = sentence.split()
        # a long sentence in pieces: a short context still gets a haystack of several
        sentences += [" ".join(words[k:k + 24]) + " " for k in range(0, len(words), 24)]
    if len(sentences) < 2:
        raise EvalError("the filler text has no sentences to build a haystack from")
    lengths = [len(lm.encode(s)) for s in sentences]
    rng = random.Random(f"{task}:{seed}")
    made = []
    for index in range(count):
        facts, question, answer = _facts(task, rng, index)
        room = context - 1 - sum(len(lm.encode(fact + " ")) for _, fact in facts)
        start, haystack, tokens = rng.randrange(len(sentences)), [], 0
        while True:  # consecutive sentences from a random start, wrapping, while they fit
            k = (start + len(haystack)) % len(sentences)
            if haystack and tokens + lengths[k] > room:
                break
            haystack.append(sentences[k])
            tokens += lengths[k]
        places = [(round(depth * len(haystack)), k) for k, (depth, _) in enumerate(facts)]
        for place, k in sorted(places, reverse=True):  # the last first: the places before it stay put, and
            haystack.insert(place, facts[k][1] + " ")  # facts at one place come in the order they are listed
        text = "".join(haystack).rstrip()
        head = [lm.bos_id] + lm.encode(text)
        asked = lm.encode("\n\nQuestion: " + question)
        joint = lm.encode("\n\nQuestion: " + question + answer)
        answer_ids = joint[len(asked):] if joint[:len(asked)] == asked else lm.encode(answer)
        ids = head + asked + answer_ids
        if len(ids) > lm.max_positions:
            raise EvalError(f"a {task} instance is {len(ids)} tokens, more than {lm.name}'s {lm.max_positions} "
                            "positions: give a smaller --context")
        made.append(Instance(task, ids, len(head), len(head) + len(asked), answer.strip(), facts[0][0]))
    return made


@torch.inference_mode()
def answers_exactly(lm, instance: Instance, config: BrainConfig) -> bool:
    """Whether a brain under `config`, started on the instance's context, then reading its
    question a token per tick, ranks every answer token first (teacher-forced)."""
    ids = instance.ids
    brain = Brain.start(lm, ids[:instance.question_at], config)
    for i in range(instance.question_at, len(ids)):
        if i >= instance.answer_at and int(brain.state.next_logits.argmax()) != ids[i]:
            return False
        if i == len(ids) - 1:
            return True
        record = brain.step(force=ids[i])
        if record.rebuilt:  # a failed tick added nothing: once more
            record = brain.step(force=ids[i])
            if record.rebuilt:
                raise RuntimeError(f"tick {brain.tick} failed twice: {record.error}")
    return True


@dataclass
class TaskRow:
    """One task under one cache: instances answered exactly, of `total`."""

    task: str
    run: str  # "full", or POLICY[+recall]@BUDGET
    budget: int | None
    exact: int
    total: int

    @property
    def rate(self) -> float:
        return self.exact / self.total

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """Wilson's 95% interval of the rate."""
        n, p = self.total, self.rate
        centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5 / (1 + z * z / n)
        return max(0.0, centre - half), min(1.0, centre + half)


def evaluate_tasks(lm, filler: str, *, tasks, configs: dict[str, BrainConfig], context: int, count: int,
                   seed: int = 0, on_run=lambda row: None) -> list[TaskRow]:
    """Every task's instances under the full cache and under each of `configs` (label: config)."""
    from .stream import reference_config

    rows = []
    for task in tasks:
        instances = make_instances(lm, task, filler, context=context, count=count, seed=seed)
        longest = max(len(instance.ids) for instance in instances)
        for label, config in {"full": reference_config(longest), **configs}.items():
            exact = sum(answers_exactly(lm, instance, config) for instance in instances)
            rows.append(TaskRow(task, label, None if label == "full" else config.budget, exact, len(instances)))
            on_run(rows[-1])
    return rows


def task_table(rows: list[TaskRow]) -> str:
    """Markdown: a task a row, a cache a column, exact / total and the rate."""
    runs = list(dict.fromkeys(row.run for row in rows))
    tasks = list(dict.fromkeys(row.task for row in rows))
    cell = {(row.task, row.run): row for row in rows}
    lines = ["| task | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for task in tasks:
        lines.append(f"| {task} | " + " | ".join(f"{cell[task, run].exact}/{cell[task, run].total}" for run in runs) + " |")
    totals = {run: (sum(r.exact for r in rows if r.run == run), sum(r.total for r in rows if r.run == run)) for run in runs}
    lines.append("| all | " + " | ".join(f"**{e}/{t}** ({e / t:.0%})" for e, t in totals.values()) + " |")
    return "\n".join(lines)


def write_task_results(rows: list[TaskRow], out, meta: dict) -> list:
    """tasks.csv (a row per task and cache, with Wilson's interval), tasks.json (the same and
    `meta`), tasks.md (the table)."""
    import csv
    import json
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = [{"task": r.task, "run": r.run, "budget": r.budget, "exact": r.exact, "total": r.total,
                "rate": round(r.rate, 4), "low": round(r.interval()[0], 4), "high": round(r.interval()[1], 4)}
               for r in rows]
    with open(out / "tasks.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    (out / "tasks.json").write_text(json.dumps({**meta, "rows": records}, indent=1), encoding="utf-8")
    (out / "tasks.md").write_text(task_table(rows) + "\n", encoding="utf-8")
    return [out / "tasks.csv", out / "tasks.json", out / "tasks.md"]


def main(*, tasks: list[str], model: str = "smollm2", text=None, budgets=None, policies=None, context: int = 2048,
         instances: int = 8, seed: int = 0, out="eval_results", recall: bool = False, device=None, dtype=None,
         weights=None, **settings) -> list[TaskRow]:
    """`positronic eval --task NAME`: check the settings, load the model, run every task under the
    full cache and each policy and budget (the product's default among them), print the table,
    write tasks.csv/.json/.md. `settings`: the runs' cache settings (RunSettings' fields)."""
    import sys

    from ..models import load_model
    from .cli import default_sweep, read_text, run_settings, trained_gates
    from .stream import RunSettings
    from .sweep import DEFAULT_BUDGETS

    names = list(TASKS) if "all" in tasks else list(dict.fromkeys(tasks))
    for name in names:
        if name not in TASKS:
            raise EvalError(f"--task {name!r} is not a task; choose from {', '.join(TASKS)} or all")
    if instances < 1:
        raise EvalError(f"--instances must be >= 1, got {instances}")
    if context < 64:
        raise EvalError(f"--context must be >= 64 tokens, got {context}")
    budgets = list(budgets or DEFAULT_BUDGETS)
    recalled: tuple[str, ...] = ()
    if not policies:
        policies, recalled, gates = default_sweep(model, min(budgets), RunSettings.of(settings))
        settings = settings | {"gates": gates}
    configs = {f"{policy}{'+recall' if on else ''}@{budget}": config
               for (policy, on, budget), config in run_settings(settings, list(policies), budgets, recall=recall,
                                                                 recalled=recalled).items()}
    body, text_name = read_text(text)
    lm = load_model(model, device=device, dtype=dtype, weights=weights)
    if any(config.gates == AUTO_GATES for config in configs.values()):  # trained (or found) before any task runs
        gates = trained_gates(lm, {"gates": AUTO_GATES})["gates"]
        configs = {label: replace(config, gates=gates) if config.gates == AUTO_GATES else config
                   for label, config in configs.items()}
    if context + 64 > lm.max_positions:
        raise EvalError(f"--context {context} leaves no room for the question within {lm.name}'s "
                        f"{lm.max_positions} positions")

    def done(row: TaskRow) -> None:
        print(f"{row.task} {row.run}: {row.exact}/{row.total} exact", file=sys.stderr, flush=True)

    rows = evaluate_tasks(lm, body, tasks=names, configs=configs, context=context, count=instances, seed=seed,
                          on_run=done)
    print(task_table(rows))
    paths = write_task_results(rows, out, {"model": lm.name, "filler": text_name, "context": context,
                                           "instances": instances, "seed": seed, "tasks": names})
    print("wrote " + ", ".join(str(p) for p in paths))
    return rows
