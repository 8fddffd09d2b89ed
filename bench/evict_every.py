"""What editing every N ticks costs: teacher-forced perplexity of the shared-row policies at
`--evict-every N` against the full cache and against each policy's own schedule.

    python bench/evict_every.py --text FILE [--text FILE2] --offset 10000 --jobs 2

A shared-row policy frees rows when the cache reaches its budget: by default llama.cpp's batch
(budget // 16 + 1 rows, one edit every 17 ticks at a budget of 256; brightness: its
repair_batch, 8), with `evict_every N` exactly N rows once every N ticks (the live length moves
between budget - N + 1 and budget: the budget stays hard, the slack is below it). N = 1 keeps
the cache at its budget, every tick an edit; a large N holds fewer rows on average and edits
rarely (kvpress's DecodingPress compresses every N steps instead, its slack above the target).

BOS + --tokens tokens of each text (the excerpt rule of bench/texts.py) go through
`positronic eval`'s own stream (`run_stream`: the tick loop, each token forced), one run per
(policy, N) plus the full cache; per-token NLLs pair between runs, so each ratio to the policy's
default schedule gets a 95% moving-block bootstrap interval (bench/significance.py's). Prints a
markdown table (perplexity, x the full cache, x the default schedule [interval], ms a tick
while --jobs runs shared the host) and writes --out/evict_every.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.significance import paired_ratio  # noqa: E402  (numpy only)
from bench.texts import excerpt  # noqa: E402

POLICIES = ("h2o", "scored", "brightness", "streaming")
EVERY = (1, 64)  # beside each policy's own (brightness 8; the others budget // 16 + 1, 17 at 256)


def _run(job: tuple) -> tuple:
    """One stream in a worker process (1 torch thread): (key, nll, seconds, max_live)."""
    model, text, offset, tokens, policy, budget, every = job
    import torch

    torch.set_num_threads(1)
    from positronic.brain.loop import BrainConfig
    from positronic.evaluate.stream import reference_config, run_stream
    from positronic.models import load_model

    lm = load_model(model, device="cpu")
    ids = [lm.bos_id] + lm.encode(excerpt(Path(text), offset))[:tokens]
    if policy == "full":
        config = reference_config(len(ids))
    else:
        config = BrainConfig(policy=policy, budget=budget, evict_every=every)
        config.validate()
    result = run_stream(lm, ids, config)
    return (Path(text).stem, policy, every), result.nll, result.seconds, result.max_live


def interval(r) -> str:
    return f"{r.value:.3f} [{r.low:.3f}–{r.high:.3f}]"


def ppl(nll) -> float:
    return math.exp(sum(nll) / len(nll))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=Path, action="append", required=True, help="a text file (repeatable)")
    parser.add_argument("--offset", type=int, default=10_000, help="excerpt from this character (bench/texts.py)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--every", nargs="+", type=int, default=list(EVERY), help="values of N (0: the policy's own)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once, one thread each")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "eval_results")
    args = parser.parse_args(argv)
    for path in args.text:
        if not path.is_file():
            parser.error(f"--text {path}: no such file")
    if any(n < 0 for n in args.every):
        parser.error("--every values must be >= 0")
    every = sorted(set(args.every) | {0})  # the default schedule is every ratio's reference
    jobs = [(args.model, str(t), args.offset, args.tokens, "full", None, 0) for t in args.text]
    jobs += [(args.model, str(t), args.offset, args.tokens, p, args.budget, n)
             for t in args.text for p in args.policies for n in every]
    runs, cache = {}, args.out / "evict_every"  # one file per run: an interrupted sweep resumes
    cache.mkdir(parents=True, exist_ok=True)

    def cached(job) -> Path:
        model, text, offset, tokens, policy, budget, n = job
        return cache / f"{model.replace(':', '_')}_{Path(text).stem}_{offset}_{tokens}_{policy}_{budget}_{n}.json"

    for job in jobs:
        if cached(job).is_file():
            runs[(Path(job[1]).stem, job[4], job[6])] = json.loads(cached(job).read_text())
    todo = [job for job in jobs if not cached(job).is_file()]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for done, (job, (key, nll, seconds, live)) in enumerate(zip(todo, pool.map(_run, todo)), 1):
            runs[key] = dict(nll=nll, seconds=seconds, max_live=live)
            cached(job).write_text(json.dumps(runs[key]))
            print(f"[{done}/{len(todo)}] {key[0]} {key[1]} N={key[2]}: ppl {ppl(nll):.3f} in {seconds:.0f} s",
                  file=sys.stderr, flush=True)
    lines = [f"{args.model}, budget {args.budget}, BOS + {args.tokens} tokens from character {args.offset}; "
             f"{datetime.date.today()}, {args.jobs} runs at a time, 1 thread each", "",
             "| text | policy | N | ppl | × full | × own schedule [95%] | ms/tick |", "|---|---|---|---|---|---|---|"]
    for text in [t.stem for t in args.text]:
        full = runs[(text, "full", 0)]["nll"]
        lines.append(f"| {text} | full cache | | {ppl(full):.3f} | | | |")
        for policy in args.policies:
            own = runs[(text, policy, 0)]["nll"]
            for n in every:
                run = runs[(text, policy, n)]
                vs = "" if n == 0 else interval(paired_ratio(run["nll"], own))
                label = f"{n}" if n else "own"
                lines.append(f"| {text} | {policy} | {label} | {ppl(run['nll']):.3f} | "
                             f"{ppl(run['nll']) / ppl(full):.3f} | {vs} | {1000 * run['seconds'] / len(run['nll']):.1f} |")
    if len(args.text) > 1:  # pooled: every text's tokens at once, each text's blocks from that text
        for policy in args.policies:
            for n in every[1:]:
                pooled = paired_ratio([runs[(t.stem, policy, n)]["nll"] for t in args.text],
                                      [runs[(t.stem, policy, 0)]["nll"] for t in args.text])
                lines.append(f"| pooled | {policy} | {n} | | | {interval(pooled)} | |")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "evict_every.json"
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                "runs": [dict(text=k[0], policy=k[1], every=k[2], **v) for k, v in runs.items()]}))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
