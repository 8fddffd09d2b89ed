"""Core v4's rounds against today's batch: the host's time per round as B grows.

    python bench/rounds.py [--model random:tiny] [--budget 256] [--sizes 1 8 32] [--ticks 16]
                           [--repeats 3] [--policies streaming h2o smartkv]

For each policy and B, B brains (different prompts, all past their budget, so every round
edits) make `--ticks` tokens each two ways, in turn, `--repeats` rounds:
  batch    `positronic.batch.Batch(engine=False)`: each brain's own tick, in Python, one forward for all;
  core v4  `positronic.batch.Engine`: one round of batched tensor work for all
           (positronic/state/slots.py, positronic/presses/).
It prints ms per round for both, the engine's forward and its host time outside the forward
per round, that time against B = 1's, the time the mirrors then take to catch up on the
rounds (`fold`, per round: ledger entries and token texts, Python per sequence, done when a
mirror is read rather than in the round), and whether both made the same tokens (greedy: the
two attend over different widths, so a near-tie may differ in the last bits; the share of
equal tokens is printed), the torch operations a round dispatches (`ops`: each a kernel launch
on a GPU, where the host's time is their count, not their sizes), and (`alone`, B > 1) the share of sequences whose tokens in the round
equal those they make in an engine of their own: Core v4 promises all of them, on any device
and dtype. Medians over the rounds; the header notes the load.

    python bench/rounds.py --model random:tinyllama --device cuda --dtype bfloat16 --sizes 1 8 32 64 smartkv (without
recall) runs the model's shipped gates, or untrained ones for a random model (bench/batch.py's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.batch import batch_arguments, batched, brains, configs  # noqa: E402  (bench/batch.py: the same prompts, brains, batch)

from positronic.batch.engine import Engine  # noqa: E402
from positronic.models import load_model, weight_only  # noqa: E402
from positronic.smartkv.gates import bench_gates  # noqa: E402
from positronic.util import TorchOps  # noqa: E402


def with_engine(lm, group, ticks: int, budget: int, compiled: bool = False
                ) -> tuple[float, float, float, list[list[int]], int]:
    """ms a round, of which the forward (on a GPU: its launch, not its run), the mirrors' catching
    up per round, each sequence's tokens, and the torch operations one more round dispatches
    (counted apart: counting slows the ops down). `compiled`: the forward one graph
    (positronic/models/compiled.py; compiled before the timed rounds, see main)."""
    engine = Engine(lm, slots=len(group), capacity=budget, score_layers=group[0].config.recorded_layers,
                    compiled=compiled)
    for k, brain in enumerate(group):
        engine.join(k, brain)
    tokens = [[] for _ in group]
    forward = 0.0
    start = time.perf_counter()
    for _ in range(ticks):
        for k, token in engine.step().items():
            tokens[k].append(token)
        forward += engine.state.forward_seconds
    if lm.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / ticks
    start = time.perf_counter()
    engine.state.fold()  # the mirrors take the rounds (ledger entries, texts): per sequence, off the round
    folded = (time.perf_counter() - start) / ticks
    # under an op counter a compiled round, and int8-weight-only's compiled products, run eagerly:
    # the count would not be this round's
    if compiled or lm.weights == "int8-weight-only":
        return seconds, forward / ticks, folded, tokens, "-"
    with TorchOps() as ops:
        engine.step()
    return seconds, forward / ticks, folded, tokens, ops.count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    batch_arguments(parser, model="random:tiny", sizes=[1, 8, 32], ticks=16, policies=["streaming", "h2o"])
    parser.add_argument("--compiled", action="store_true",
                        help="the engine's forward as one compiled graph per bucket (compiled before timing)")
    parser.add_argument("--weights", help="the linear layers' format (run.py --weights; default: the model's own)")
    parser.add_argument("--no-tiles", action="store_true",
                        help="int8-weight-only: every eager product by the one-row loop, prompts and eager "
                             "batched rounds included (the code before the tiles, for comparison)")
    args = parser.parse_args(argv)
    if args.no_tiles and args.weights != "int8-weight-only":
        parser.error("--no-tiles is for --weights int8-weight-only (the tiles are its kernel)")
    with mock.patch.object(weight_only, "ROWS", sys.maxsize) if args.no_tiles else contextlib.nullcontext():
        return run(args)


def run(args) -> int:
    lm = load_model(args.model, device=args.device, dtype=args.dtype, weights=args.weights)
    print(f"model {args.model}  {lm.device.type}  {str(lm.dtype).removeprefix('torch.')}  budget {args.budget}  "
          f"ticks {args.ticks} x {args.repeats}  torch {torch.__version__} threads {torch.get_num_threads()}  "
          f"load {os.getloadavg()[0]:.2f}  {time.strftime('%Y-%m-%d %H:%M')}"
          f"{'  core v4 compiled' if args.compiled else ''}  weights {lm.weights}{' (no tiles)' if args.no_tiles else ''}")
    print(f"{'policy':10} {'B':>3} {'batch ms':>9} {'core ms':>8} {'forward':>8} {'outside':>8} {'vs B=1':>7} "
          f"{'speed-up':>8} {'fold ms':>8} {'ops':>5} {'equal':>6} {'alone':>6}")
    folder = tempfile.TemporaryDirectory()
    _, gates = bench_gates(lm, folder.name)
    for policy in args.policies:
        config = configs(policy, args.budget, gates)
        first_outside = None
        if args.compiled:  # every bucket's graph made before the clock runs (a model's graphs are shared)
            for size in sorted({1, *args.sizes}):
                with_engine(lm, brains(lm, size, config, args.budget), 2, args.budget, compiled=True)
        for size in args.sizes:
            old, new, forward, fold, same, alone, ops = [], [], [], [], [], "-", 0
            for repeat in range(args.repeats):
                seconds, old_tokens = batched(brains(lm, size, config, args.budget), args.ticks + 1, engine=False)
                old.append(seconds)
                seconds, seconds_forward, seconds_fold, new_tokens, ops = with_engine(
                    lm, brains(lm, size, config, args.budget), args.ticks, args.budget, args.compiled)
                new.append(seconds)
                forward.append(seconds_forward)
                fold.append(seconds_fold)
                pairs = [(a, b) for x, y in zip(old_tokens, new_tokens) for a, b in zip(x, y)]
                same.append(sum(a == b for a, b in pairs) / len(pairs))
                if size > 1 and repeat == 0:  # each sequence in an engine of its own: batched must equal alone
                    lone = [with_engine(lm, [brain], args.ticks, args.budget, args.compiled)[3][0]
                            for brain in brains(lm, size, config, args.budget)]
                    alone = f"{sum(x == y for x, y in zip(lone, new_tokens)) / size:.0%}"
            old_ms, new_ms = statistics.median(old) * 1e3, statistics.median(new) * 1e3
            forward_ms = statistics.median(forward) * 1e3
            outside = statistics.median(n - f for n, f in zip(new, forward)) * 1e3
            first_outside = first_outside or outside
            print(f"{policy:10} {size:>3} {old_ms:>9.1f} {new_ms:>8.1f} {forward_ms:>8.1f} {outside:>8.2f} "
                  f"{outside / first_outside:>6.2f}x {old_ms / new_ms:>7.2f}x {statistics.median(fold) * 1e3:>8.2f} {ops:>5} "
                  f"{min(same):>6.1%} {alone:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
