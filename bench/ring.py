"""Streaming on the ring store against streaming on the splice store: ms per tick.

    python bench/ring.py [--models random:tinyllama smollm2] [--contexts 256 1024 2048]
                         [--ticks 64] [--rounds 5] [--threads N]

For each model and context (the budget; the prompt fills it, so the run evicts from the first
tick) two brains run the streaming policy (sinks 4, window 32, greedy) side by side: one with
the default splice store, one with `kv_store="ring"`. Rounds alternate between them (and which
goes first), each round `--ticks` ticks of each, and the brains carry on from round to round,
so a noisy machine's drift hits both alike and the splice store's occasional pack-down of
every row (when its window reaches the end of the buffer) falls inside the measurement.
Reported per store: the mean ms per tick over every measured tick (what a long run pays,
pack-downs and eviction batches included) and the median of the rounds' means; `ring/splice`
is the ratio of the means (the ring store's target: at most 1). `moved` counts rows the ring
copied (0: evictions only moved its cursor), `packs` the splice store's pack-downs seen.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic import load_model  # noqa: E402
from positronic.brain.loop import Brain, BrainConfig  # noqa: E402

STORES = ("splice", "ring")


def context_ids(lm, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(length)
    return [lm.bos_id] + torch.randint(3, lm.vocab_size, (length - 1,), generator=generator).tolist()


def sync(lm) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize()


def ticks(lm, brain: Brain, count: int) -> list[float]:
    """Seconds of each of `count` ticks."""
    times = []
    for _ in range(count):
        sync(lm)
        start = time.perf_counter()
        brain.step()
        sync(lm)
        times.append(time.perf_counter() - start)
    return times


def packs(brain: Brain) -> int:
    """Times the splice store's window started again at buffer row 0 (seen from outside: its
    start went down without a growth). Sampled per tick by the caller."""
    return brain.state.cache.layers[0].start


@torch.inference_mode()
def measure(lm, context: int, count: int, rounds: int) -> dict:
    ids = context_ids(lm, context)
    brains = {store: Brain.start(lm, ids, BrainConfig(policy="streaming", budget=context, window=32, temperature=0,
                                                      kv_store=store)) for store in STORES}
    for brain in brains.values():  # warm-up: allocations, the first eviction batches
        ticks(lm, brain, min(count, 8))
    times = {store: [] for store in STORES}
    round_means = {store: [] for store in STORES}
    pack_downs, start = 0, packs(brains["splice"])
    for index in range(rounds):
        for store in (STORES if index % 2 == 0 else STORES[::-1]):
            if store == "splice":
                taken = []
                for _ in range(count):
                    taken += ticks(lm, brains[store], 1)
                    now = packs(brains[store])
                    pack_downs += now < start
                    start = now
            else:
                taken = ticks(lm, brains[store], count)
            times[store] += taken
            round_means[store].append(statistics.fmean(taken))
    ring = brains["ring"].state
    assert ring.live_token_ids() == brains["splice"].state.live_token_ids(), "the stores must run the same tokens"
    return {"mean": {s: statistics.fmean(times[s]) for s in STORES},
            "median": {s: statistics.median(round_means[s]) for s in STORES},
            "moved": sum(layer.moved_rows for layer in ring.cache.layers), "packs": pack_downs,
            "ticks": len(times["ring"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["random:tinyllama", "smollm2"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--ticks", type=int, default=64, help="ticks per store per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.ticks < 1 or args.rounds < 1 or min(args.contexts) < 48:
        parser.error("--ticks and --rounds must be >= 1, every context >= 48 (sinks + window + an eviction batch)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds x {args.ticks} ticks "
          "per store, interleaved")
    print(f"{'model':<18} {'context':>7} {'splice ms':>10} {'ring ms':>8} {'ring/splice':>11} "
          f"{'splice med':>10} {'ring med':>8} {'moved':>5} {'packs':>5} {'ticks':>5}")
    for name in args.models:
        lm = load_model(name, device=args.device, dtype=args.dtype)
        for context in args.contexts:
            if context > lm.max_positions:
                print(f"{name:<18} {context:>7} skipped: above the model's {lm.max_positions} positions")
                continue
            r = measure(lm, context, args.ticks, args.rounds)
            mean, median = r["mean"], r["median"]
            print(f"{name:<18} {context:>7} {mean['splice'] * 1e3:>10.2f} {mean['ring'] * 1e3:>8.2f} "
                  f"{mean['ring'] / mean['splice']:>11.3f} {median['splice'] * 1e3:>10.2f} {median['ring'] * 1e3:>8.2f} "
                  f"{r['moved']:>5} {r['packs']:>5} {r['ticks']:>5}", flush=True)


if __name__ == "__main__":
    main()
