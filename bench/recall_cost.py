"""What the size of SmartKV's recall index costs a tick: the default policy with its index full.

    python bench/recall_cost.py [--text FILE] [--budget 256] [--capacities 2048 4096] [--ticks 64] [--repeats 3]

A Brain with the default policy (SmartKV, recall, memory ranked by recent use) starts on a prompt of
BOS + (largest capacity + budget + 64) tokens of --text, so the bulk prune fills every index to its
capacity at once; then --ticks greedy ticks are timed. Each capacity runs in turn, --repeats times
(alternating, one sitting); printed: ms a tick (median of the repeats, and each), the indexed
tokens, and the ratio to the first capacity. Recall scores every indexed key every tick (recall.py),
so the tick grows with the index: this is the price of `SmartKVPolicy.recall_capacity`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from positronic import load_model  # noqa: E402
from positronic.brain.config import AUTO_GATES, default_memory_rank  # noqa: E402
from positronic.brain.defaults import default_policy  # noqa: E402
from positronic.brain.loop import Brain, BrainConfig  # noqa: E402
from positronic.evaluate import DEFAULT_TEXT, read_text  # noqa: E402
from positronic.smartkv.first_use import resolve  # noqa: E402
from positronic.smartkv.policy import SmartKVPolicy  # noqa: E402


def timed(lm, ids: list[int], config: BrainConfig, capacity: int, ticks: int) -> tuple[float, int]:
    """ms a tick over `ticks` greedy ticks after starting on `ids`, and the tokens indexed."""
    shipped = SmartKVPolicy.recall_capacity
    SmartKVPolicy.recall_capacity = capacity  # read when the policy is made, below
    try:
        brain = Brain.start(lm, ids, config)
    finally:
        SmartKVPolicy.recall_capacity = shipped
    brain.step()  # the first tick's one-off work (allocations) outside the timing
    start = time.perf_counter()
    for _ in range(ticks):
        brain.step()
    return (time.perf_counter() - start) / ticks * 1e3, len(brain.policy.recall.ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--capacities", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--ticks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    for name in ("budget", "ticks", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.capacities) < 1:
        parser.error(f"--capacities must be >= 1, got {min(args.capacities)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    choice = default_policy(args.model, BrainConfig(budget=args.budget), recall=None, train=True)
    if choice.policy != "smartkv" or not choice.recall:
        raise SystemExit(f"{args.model}'s default is {choice.policy} without recall: nothing to measure")
    gates = resolve(lm) if choice.gates == AUTO_GATES else choice.gates  # gates trained on first use: made now
    config = replace(BrainConfig(budget=args.budget, policy="smartkv", recall=True, gates=gates,
                                 memory_rank=default_memory_rank("smartkv", True)), temperature=0.0)
    text, _ = read_text(args.text)
    wanted = max(args.capacities) + args.budget + 64
    ids = [lm.bos_id] + lm.encode(" ".join([text] * (1 + wanted * 6 // max(len(text), 1))))[:wanted]
    if len(ids) > lm.max_positions - args.ticks - 2:
        raise SystemExit(f"{len(ids)} prompt tokens leave no room in {lm.name}'s {lm.max_positions} positions")
    times: dict[int, list[float]] = {c: [] for c in args.capacities}
    indexed = {}
    for _ in range(args.repeats):
        for capacity in args.capacities:
            ms, indexed[capacity] = timed(lm, ids, config, capacity, args.ticks)
            times[capacity].append(ms)
    first = statistics.median(times[args.capacities[0]])
    print(f"{lm.name}, budget {args.budget}, {len(ids)} prompt tokens, {args.ticks} ticks x {args.repeats}, "
          f"torch threads {torch.get_num_threads()}")
    print("| capacity | indexed | ms a tick (median) | each | x first |")
    print("|---|---|---|---|---|")
    for capacity in args.capacities:
        median = statistics.median(times[capacity])
        print(f"| {capacity} | {indexed[capacity]} | {median:.1f} | {' '.join(f'{t:.1f}' for t in times[capacity])} "
              f"| {median / first:.3f} |")


if __name__ == "__main__":
    main()
