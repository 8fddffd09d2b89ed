"""Batched ticks against one brain at a time: what B sequences cost per token.

    python bench/batch.py [--model smollm2] [--budget 256] [--sizes 1 2 4 8] [--ticks 24]
                          [--repeats 3] [--policies streaming smartkv+recall] [--device cpu]

For each policy and batch size B, B brains (different prompts, all past their budget, so
every tick edits) tick `--ticks` times two ways, in turn, `--repeats` rounds:
  alone     one after another, each tick a forward of its own (what the server did before
            batching: one model thread, one brain step at a time);
  batched   `positronic.batch.Batch`: the brains Core v4 runs seated in engine rounds (one round of
            batched tensor work a tick); with `--no-engine` every brain's own tick, one forward for all.
It prints ms per token (a tick of B brains makes B tokens), tokens/s, batched / alone, and
the batch's speed-up over B = 1, medians over the rounds; the header notes the load and
torch's threads. The brains' tokens are compared too: batched must equal alone (a mismatch
is printed and the exit status is 1).

    python bench/batch.py --stall 2000 [--chunks 512 64]

How long a new sequence's long prompt holds up one that is generating: before batching the
server's one model thread ran the whole prefill between two of the other's ticks (the gap is
the prefill, measured here as `Brain.start` alone); in a batch (`Rounds`) the prefill goes
in chunk by chunk, each chunk in a forward with the other's token. Prints the
generating sequence's longest gap between two tokens while the prompt goes in, per chunk size.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic.batch import Batch  # noqa: E402
from positronic.brain.loop import Brain, BrainConfig  # noqa: E402
from positronic.batch import Rounds  # noqa: E402
from positronic.models import load_model  # noqa: E402
from positronic.smartkv.gates import bench_gates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# B prompts at a stride of 97 tokens: with Alice after the README there is room for B = 32
TEXT = "\n\n".join((ROOT / name).read_text(encoding="utf-8") for name in ("README.md", "texts/alice_ch1-2.txt"))


def configs(policy: str, budget: int, gates: str = "") -> dict:
    """A policy as the scripts name it: NAME[+recall][@TEMPERATURE] (sampling with top-k 40; greedy without)."""
    policy, _, temperature = policy.partition("@")
    name, _, extra = policy.partition("+")
    sampling = dict(temperature=float(temperature), top_k=40) if temperature else dict(temperature=0)
    # Core v4's rounds do not reread yet (SmartKV with recall): both sides of a comparison look in the plan
    return dict(policy=name, recall=extra == "recall", budget=budget, **sampling,
                **({"gates": gates} if name == "smartkv" else {}),
                **({"reread": False} if name == "smartkv" and extra == "recall" else {}))


def brains(lm, size: int, config: dict, budget: int) -> list[Brain]:
    return [brain(lm, k, config, budget) for k in range(size)]


def brain(lm, k: int, config: dict, budget: int) -> Brain:
    """The k-th of `brains`: its prompt starts 97 * k tokens into TEXT (wrapping), budget + 32 long."""
    ids = lm.encode(TEXT)
    start = 97 * k % max(1, len(ids) - budget - 32)
    return Brain.start(lm, [lm.bos_id] + ids[start : start + budget + 32], BrainConfig(**config, seed=k))


def alone(group: list[Brain], ticks: int) -> tuple[float, list[list[int]]]:
    tokens = [[] for _ in group]
    start = time.perf_counter()
    for _ in range(ticks):
        for k, member in enumerate(group):
            tokens[k].append(member.step().token_id)
    return (time.perf_counter() - start) / ticks, tokens


def batched(group: list[Brain], ticks: int, *, engine: bool = True) -> tuple[float, list[list[int]]]:
    """Seconds a tick over `ticks` ticks of `group` as one Batch (seated in engines, or with
    `engine=False` each brain's own tick and one forward for all), the first (the seating) untimed,
    and each brain's tokens."""
    batch = Batch(engine=engine)
    for k, member in enumerate(group):
        batch.join(k, member)
    tokens = [[] for _ in group]
    for k, record in batch.step().items():  # seats the brains an engine runs: a copy of their rows, once
        if isinstance(record, Exception):
            raise record
        tokens[k].append(record.token_id)
    ticks -= 1
    start = time.perf_counter()
    for _ in range(ticks):
        for k, record in batch.step().items():
            if isinstance(record, Exception):
                raise record
            tokens[k].append(record.token_id)
    return (time.perf_counter() - start) / max(ticks, 1), tokens


def stall(lm, tokens: int, budget: int, chunks: list[int]) -> None:
    config = configs("streaming", budget)
    ids = lm.encode(TEXT)
    prompt = [lm.bos_id] + (ids * (tokens // len(ids) + 1))[: tokens - 1]
    start = time.perf_counter()
    Brain.start(lm, prompt, BrainConfig(**config))
    alone_s = time.perf_counter() - start
    tick = brains(lm, 1, config, budget)[0]
    start = time.perf_counter()
    for _ in range(8):
        tick.step()
    tick_s = (time.perf_counter() - start) / 8
    print(f"a {tokens}-token prompt (policy streaming, budget {budget}): Brain.start alone {alone_s:.2f} s; "
          f"a tick alone {1000 * tick_s:.0f} ms")
    print(f"before batching: the other sequence waits {alone_s + tick_s:.2f} s for its next token")
    for chunk in chunks:
        meeting, done, gaps = Rounds(prefill_chunk=chunk), [], []

        def generate() -> None:
            last = time.perf_counter()
            while not done:
                tick.step()
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        def prefill() -> None:
            try:
                Brain.start(lm, prompt, BrainConfig(**config))
            finally:
                done.append(True)

        start = time.perf_counter()
        outcomes = meeting.run({"generate": generate, "prefill": prefill})
        if errors := [outcome for outcome in outcomes.values() if isinstance(outcome, Exception)]:
            raise errors[0]
        print(f"batched, chunks of {chunk:>4}: prompt in after {time.perf_counter() - start:.2f} s; the other made "
              f"{len(gaps)} tokens meanwhile, longest gap {max(gaps):.2f} s, median {statistics.median(gaps):.2f} s")


def batch_arguments(parser: argparse.ArgumentParser, *, model: str, sizes: list[int], ticks: int,
                    policies: list[str]) -> None:
    """The options this script and bench/rounds.py share (B brains of a model, ticked in rounds)."""
    parser.add_argument("--model", default=model)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="default: float16 on cuda, float32 on cpu")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=sizes)
    parser.add_argument("--ticks", type=int, default=ticks)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", nargs="+", default=policies,
                        help="NAME[+recall][@TEMPERATURE], e.g. smartkv+recall@0.8 (sampling, top-k 40)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    batch_arguments(parser, model="smollm2", sizes=[1, 2, 4, 8], ticks=24, policies=["streaming", "smartkv+recall"])
    parser.add_argument("--no-engine", dest="engine", action="store_false",
                        help="Batch(engine=False): every brain's own tick, one shared forward")
    parser.add_argument("--stall", type=int, default=0, metavar="TOKENS",
                        help="measure how long a prompt of TOKENS holds up a generating sequence instead")
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 64], help="prefill chunk sizes (--stall)")
    args = parser.parse_args(argv)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.stall:
        stall(lm, args.stall, args.budget, args.chunks)
        return 0
    print(f"model {args.model}  {lm.device}  {str(lm.dtype).removeprefix('torch.')}  budget {args.budget}  ticks {args.ticks} x {args.repeats} rounds  "
          f"torch {torch.__version__} threads {torch.get_num_threads()}  load {os.getloadavg()[0]:.2f}  "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'policy':<16} {'B':>3} {'alone ms/tok':>13} {'batched ms/tok':>15} {'batched tok/s':>14} "
          f"{'batched/alone':>14} {'tok/s vs B=1':>13}")
    mismatches = 0
    folder = tempfile.TemporaryDirectory()
    _, gates = bench_gates(lm, folder.name)
    for policy in args.policies:
        config = configs(policy, args.budget, gates)
        first = None
        for size in args.sizes:
            times = {"alone": [], "batched": []}
            for _ in range(args.repeats):
                for mode, run in (("alone", alone), ("batched", functools.partial(batched, engine=args.engine))):
                    group = brains(lm, size, config, args.budget)
                    for brain in group:  # one untimed tick each: first-tick work out of the way
                        brain.step()
                    seconds, tokens = run(group, args.ticks)
                    times[mode].append(seconds / size)
                    if mode == "alone":
                        want = tokens
                    elif tokens != want:
                        mismatches += 1
                        print(f"MISMATCH {policy} B={size}: batched tokens differ from alone")
            a, b = statistics.median(times["alone"]), statistics.median(times["batched"])
            first = first or 1 / b
            print(f"{policy:<16} {size:>3} {1000 * a:>13.1f} {1000 * b:>15.1f} {1 / b:>14.2f} {b / a:>13.2f}x "
                  f"{(1 / b) / first:>12.2f}x")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
