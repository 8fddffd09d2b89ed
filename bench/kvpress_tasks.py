"""kvpress's presses on the project's retrieval tasks (`positronic eval --task`), the same instances.

    python bench/kvpress_tasks.py export --text lcet10.txt --task needle --task multikey --context 4096 \\
        --instances 5 --out bench/eval_results/tasks_4k.json           # the project's venv: the instances
    bench/.kvpress-venv/bin/python bench/kvpress_tasks.py run bench/eval_results/tasks_4k.json \\
        --budget 1024 --budget 512 --presses full snapkv tova streaming expected_attention pyramidkv knorm

**Task.** `export` writes the instances `positronic.evaluate.tasks.make_instances` makes (ids,
where the question and the answer start), so both sides score the same tokens. `run` (kvpress's
venv: kvpress pins an older transformers, so it never imports `positronic`) gives each press the
context (BOS, haystack and facts) as a prefill, which the press compresses to the budget as kvpress
does (`with press(model):` around the prefill; compression_ratio = 1 - budget / context), then
feeds the question and the answer in one forward with their true positions (as kvpress's pipeline
answers a question) and counts an instance answered when every answer token is the most likely
next token. The project's caches hold `budget` rows while the question is read a token at a time
(its policy keeps pruning to the budget); kvpress's keep every question token beside the pruned
context (at most ~30 more rows): that is kvpress's own setting, and a little more room than the
project's.

Output: a markdown table (a task a row, a press and budget a column, exact / instances) and a JSON
of every instance's verdict in --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SINKS = 4
PRESSES = ("full", "snapkv", "tova", "streaming", "expected_attention", "pyramidkv", "knorm", "observed_attention")


def export(args) -> None:
    """The project's side: the instances, as JSON."""
    from positronic.evaluate.cli import read_text
    from positronic.evaluate.stream import EvalError
    from positronic.evaluate.tasks import make_instances
    from positronic.models import ModelError, load_model

    try:
        text, _ = read_text(Path(args.text))  # as `positronic eval --task --text` reads it
        lm = load_model(args.model)
        made = []
        instances = [(task, make_instances(lm, task, text, context=args.context, count=args.instances, seed=args.seed))
                     for task in args.task]
    except (OSError, ValueError, EvalError, ModelError) as exc:  # EvalError: a task, context or count it cannot make
        raise SystemExit(f"kvpress_tasks export: {exc}") from None
    for task, made_for_task in instances:
        for instance in made_for_task:
            made.append({"task": task, "ids": instance.ids, "question_at": instance.question_at,
                         "answer_at": instance.answer_at, "answer": instance.answer, "depth": instance.depth})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": lm.name, "filler": Path(args.text).name, "context": args.context,
                                    "seed": args.seed, "instances": made}), encoding="utf-8")
    print(f"wrote {len(made)} instances to {args.out}")


def read_instances(path: Path, budgets: list[int]) -> dict:
    """`export`'s JSON; SystemExit naming the problem if it is not that, or a budget does not
    leave a context shorter than the budget to compress (nothing changes, nothing loads)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        items = data["instances"]
        ok = isinstance(items, list) and items and all(
            isinstance(i, dict) and isinstance(i.get("ids"), list) and all(type(t) is int for t in i["ids"])
            and type(i.get("question_at")) is int and type(i.get("answer_at")) is int and isinstance(i.get("task"), str)
            and 0 < i["question_at"] < i["answer_at"] < len(i["ids"]) for i in items)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"kvpress_tasks run: cannot read {path}: {exc}") from None
    if not ok:
        raise SystemExit(f"kvpress_tasks run: {path} holds no instances as `export` writes them")
    shortest = min(i["question_at"] for i in items)
    for budget in budgets:
        if not 0 < budget < shortest:
            raise SystemExit(f"kvpress_tasks run: --budget {budget} must be >= 1 and below the shortest context "
                             f"({shortest} tokens)")
    return data


def press_of(name: str, ratio: float):
    import kvpress as kp

    return {"snapkv": lambda: kp.SnapKVPress(compression_ratio=ratio),
            "tova": lambda: kp.TOVAPress(compression_ratio=ratio),
            "streaming": lambda: kp.StreamingLLMPress(compression_ratio=ratio, n_sink=SINKS),
            "expected_attention": lambda: kp.ExpectedAttentionPress(compression_ratio=ratio, n_sink=SINKS),
            "pyramidkv": lambda: kp.PyramidKVPress(compression_ratio=ratio),
            "knorm": lambda: kp.KnormPress(compression_ratio=ratio),
            "observed_attention": lambda: kp.ObservedAttentionPress(compression_ratio=ratio)}[name]()


def run(args) -> None:
    data = read_instances(args.instances, args.budget)  # refused before anything loads
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    from bench.kvpress_anchor import _null, _with_cache, model_dir

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    models = {}

    def model(attn: str):
        if attn not in models:
            made = AutoModelForCausalLM.from_pretrained(model_dir(args.model_dir), dtype=torch.float32,
                                                        attn_implementation=attn)
            models[attn] = made.eval().requires_grad_(False)
        return models[attn]

    def answered(name: str, budget: int | None, item: dict) -> bool:
        ids, q, a = item["ids"], item["question_at"], item["answer_at"]
        m = model("eager" if name == "observed_attention" else "sdpa")
        press = None if name == "full" else press_of(name, 1.0 - budget / q)
        cache = DynamicCache()
        with torch.inference_mode():
            with press(m) if press is not None else _null():
                m(input_ids=torch.tensor([ids[:q]]), use_cache=True, **_with_cache(m, cache))
            out = m(input_ids=torch.tensor([ids[q:-1]]), position_ids=torch.arange(q, len(ids) - 1)[None],
                    use_cache=True, **_with_cache(m, cache))
        best = out.logits[0, a - 1 - q:].argmax(-1).tolist()
        return best == ids[a:]

    rows, verdicts = {}, []
    runs = [("full", None)] + [(name, b) for name in args.presses if name != "full" for b in args.budget]
    for name, budget in runs:
        label = name if budget is None else f"{name}@{budget}"
        start = time.perf_counter()
        for item in data["instances"]:
            ok = answered(name, budget, item)
            verdicts.append({"run": label, "task": item["task"], "depth": item["depth"], "exact": ok})
            rows.setdefault((item["task"], label), []).append(ok)
        print(f"{label}: {sum(v['exact'] for v in verdicts if v['run'] == label)}/{len(data['instances'])} "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    tasks = list(dict.fromkeys(item["task"] for item in data["instances"]))
    labels = list(dict.fromkeys(label for _, label in rows))
    lines = ["| task | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for task in tasks:
        lines.append(f"| {task} | " + " | ".join(f"{sum(rows[task, l])}/{len(rows[task, l])}" for l in labels) + " |")
    lines.append("| all | " + " | ".join(
        f"**{sum(sum(rows[t, l]) for t in tasks)}/{sum(len(rows[t, l]) for t in tasks)}**" for l in labels) + " |")
    print("\n".join(lines))
    import importlib.metadata as md

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"instances": str(args.instances), "filler": data["filler"],
                                    "context": data["context"], "budgets": args.budget,
                                    "versions": {p: md.version(p) for p in ("kvpress", "transformers", "torch")},
                                    "verdicts": verdicts}, indent=1), encoding="utf-8")
    print(f"wrote {args.out}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="the project's venv: write the instances")
    ex.add_argument("--model", default="smollm2")
    ex.add_argument("--text", required=True, help="the haystack's text file")
    ex.add_argument("--task", action="append", required=True)
    ex.add_argument("--context", type=int, default=4096)
    ex.add_argument("--instances", type=int, default=5)
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--out", type=Path, required=True)
    go = sub.add_parser("run", help="kvpress's venv: run the presses on exported instances")
    go.add_argument("instances", type=Path)
    go.add_argument("--budget", type=int, action="append", required=True, help="rows kept of the context")
    go.add_argument("--presses", nargs="+", default=list(PRESSES[:6]), choices=PRESSES)
    go.add_argument("--threads", type=int, default=1)
    go.add_argument("--model-dir", type=Path, default=None)
    go.add_argument("--out", type=Path, default=Path("bench/eval_results/kvpress_tasks.json"))
    args = parser.parse_args(argv)
    export(args) if args.command == "export" else run(args)


if __name__ == "__main__":
    main()
