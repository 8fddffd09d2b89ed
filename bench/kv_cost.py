"""Decode cost per cache format: ms per streaming tick on float, int4 and fp4 rows.

    python bench/kv_cost.py [--model random:tinyllama] [--contexts 512 2048] [--formats float int4 fp4]
                            [--ticks 64] [--rounds 5] [--device cuda] [--unfused]

For each context (the budget; the prompt fills it, so every tick evicts and adds) one brain per
format runs the streaming policy (sinks 4, window 32, greedy) on the splice store. Rounds
alternate between the formats (in turn, the order reversed every other round) and the brains
carry on from round to round, so a noisy machine's drift hits all alike. Reported per format:
the mean ms per tick over every measured tick and its ratio to float. On a GPU each 4-bit
and fp4 row can decode through the fused Triton kernel (positronic/kv/triton_kernel.py, opt-in): their
rows run with it switched on, and `--unfused` adds a row for each with it off (the torch ops),
to show what fusing buys. On a CPU both rows run the torch ops.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ring import context_ids, ticks  # noqa: E402
from positronic.kv import formats as kv_formats
from positronic import load_model  # noqa: E402
from positronic.brain.loop import Brain, BrainConfig  # noqa: E402


def variants(formats: list[str], unfused: bool) -> list[tuple[str, str, bool]]:
    """(label, format, fused) per row: every format, then the 4-bit ones unfused if asked."""
    rows = [(name, name, True) for name in formats]
    rows += [(f"{name} unfused", name, False) for name in formats if unfused and name in kv_formats.ROW_SCALED]
    return rows


@torch.inference_mode()
def measure(lm, context: int, rows: list[tuple[str, str, bool]], count: int, rounds: int) -> dict[str, float]:
    """Mean seconds per tick of each row's brain."""
    ids = context_ids(lm, context)
    brains = {label: Brain.start(lm, ids, BrainConfig(policy="streaming", budget=context, window=32, temperature=0,
                                                      kv_format=fmt)) for label, fmt, _ in rows}
    fused = {label: on for label, _, on in rows}
    times: dict[str, list[float]] = {label: [] for label in brains}

    def run(label: str, n: int) -> list[float]:
        os.environ["POSITRONIC_FUSED_DECODE"] = "1" if fused[label] else "0"  # read at each decode
        return ticks(lm, brains[label], n)

    for label in brains:  # warm-up: allocations, kernel compilation, the first eviction batches
        run(label, min(count, 8))
    for index in range(rounds):
        for label in (list(brains) if index % 2 == 0 else list(brains)[::-1]):
            times[label] += run(label, count)
    os.environ.pop("POSITRONIC_FUSED_DECODE", None)
    return {label: statistics.fmean(t) for label, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tinyllama")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--formats", nargs="+", default=list(kv_formats.FORMATS), choices=kv_formats.FORMATS)
    parser.add_argument("--ticks", type=int, default=64, help="ticks per format per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--unfused", action="store_true", help="also run each 4-bit format without the fused kernel")
    args = parser.parse_args(argv)
    if args.ticks < 1 or args.rounds < 1 or min(args.contexts) < 48:
        parser.error("--ticks and --rounds must be >= 1, every context >= 48 (sinks + window + an eviction batch)")
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    device = torch.cuda.get_device_name() if lm.device.type == "cuda" else f"CPU x{torch.get_num_threads()}"
    rows = variants(args.formats, args.unfused)
    print(f"{lm.name} {str(lm.dtype).removeprefix('torch.')} on {device}, torch {torch.__version__}; "
          f"streaming, {args.rounds} rounds x {args.ticks} ticks per format, interleaved")
    print(f"{'context':>7} {'format':<14} {'ms/tick':>8} {'vs float':>8} {'B/token':>8}")
    for context in args.contexts:
        if context > lm.max_positions:
            print(f"{context:>7} skipped: above the model's {lm.max_positions} positions")
            continue
        mean = measure(lm, context, rows, args.ticks, args.rounds)
        base = mean.get("float")
        for label, fmt, _ in rows:
            per_token = kv_formats.bytes_per_token(fmt, layers=lm.num_layers, kv_heads=lm.num_kv_heads,
                                                   head_dim=lm.head_dim, dtype=lm.dtype)
            ratio = f"{mean[label] / base:>7.3f}x" if base else f"{'':>8}"
            print(f"{context:>7} {label:<14} {mean[label] * 1e3:>8.2f} {ratio} {per_token:>8}", flush=True)


if __name__ == "__main__":
    main()
