"""The compiled decode round (positronic/models/compiled.py) against Hugging Face `generate` and
against the eager round, in one run: what issue 70 asks of a GPU, and the same on a CPU.

    python bench/graph.py [--model random:tinyllama] [--device cuda] [--dtype bfloat16]
                          [--budget 256] [--sizes 1 8 32 64] [--ticks 64] [--long 2000]
                          [--json bench/results/gpu.json]

For each B, B sequences of the default policy (`BrainConfig`'s) past their budget (prompts of
budget + 32 tokens: every round evicts or is about to) tick `--ticks` rounds in an engine,
compiled and eager, after warm-up rounds that make each bucket's graph: ms a round, generated
tok/s, and the ratio to the weights' bandwidth floor on a GPU (bytes of weights / the device's
memory bandwidth, given by `--bandwidth` in GB/s; H200 4,800). HF `generate` (greedy, sdpa,
DynamicCache) on the same prompt in the same run: ms a token from the difference of two
lengths (the prefill cancels). Then batched = alone: the first three sequences of the largest B
against each alone in a compiled engine of its own. Then `--long` rounds in a compiled engine of
8 slots with sequences joining and leaving at random (every bucket), counting graphs made after
the warm-up (a recapture each on a GPU; 0 is the promise) and dynamo's recompiles.

Prints a table and, with `--json`, writes the figures issue 70 names (date, gpu, model, dtype,
b1_ms_per_token, hf_generate_ms_per_token, b64_tok_s, batched_equal_alone, recaptures) plus the
whole table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch import TEXT, brain, brains  # noqa: E402  (bench/batch.py: the same prompts)

from positronic.batch.engine import Engine  # noqa: E402
from positronic.brain.loop import BrainConfig  # noqa: E402
from positronic.models import load_model  # noqa: E402


def sync(lm) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize()


def hf_ms_per_token(lm, prompt: list[int], ticks: int) -> float:
    """Greedy `generate` of `ticks` + 1 tokens against 1 token: ms a decode step."""
    ids = torch.tensor([prompt], device=lm.device)
    times = {}
    for new in (1, ticks + 1, 1, ticks + 1):  # the first pair warms up
        sync(lm)
        start = time.perf_counter()
        with torch.no_grad():
            lm.model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        sync(lm)
        times[new] = time.perf_counter() - start
    return (times[ticks + 1] - times[1]) / ticks * 1e3


def engine_rounds(lm, size: int, config: dict, budget: int, ticks: int, compiled: bool, warm: int = 3):
    """ms a round of `size` sequences (after `warm` rounds), and each sequence's tokens."""
    engine = Engine(lm, slots=size, capacity=budget, compiled=compiled)
    for k, started in enumerate(brains(lm, size, config, budget)):
        engine.join(k, started)
    tokens = [[] for _ in range(size)]
    for _ in range(warm):
        for k, token in engine.step().items():
            tokens[k].append(token)
    sync(lm)
    start = time.perf_counter()
    for _ in range(ticks):
        for k, token in engine.step().items():  # the tokens come back to the host: a sync each round
            tokens[k].append(token)
    return (time.perf_counter() - start) / ticks * 1e3, tokens


def long_run(lm, config: dict, budget: int, rounds: int) -> dict:
    """Graphs made over `rounds` rounds with joins and leaves, after each bucket's first."""
    from torch._dynamo.utils import counters

    engine = Engine(lm, slots=8, capacity=budget, compiled=True)
    pool = brains(lm, 8, config, budget)
    for k in range(8):
        engine.join(k, pool[k])
    for active in (8, 4, 2, 1):  # every bucket's graph
        while len(engine) > active:
            engine.leave(engine.keys()[-1])
        engine.step()
    made, recompiles = engine.state.compiled.compiles, sum(counters["recompiles"].values())
    rng, joined, evictions = random.Random(0), 8, 0
    start = time.perf_counter()
    for _ in range(rounds):
        if len(engine) < 8 and (not len(engine) or rng.random() < 0.2):
            engine.join(joined, brain(lm, joined % 16, config, budget))
            joined += 1
        elif len(engine) > 1 and rng.random() < 0.15:
            engine.leave(rng.choice(engine.keys()))
        engine.step()
        evictions += sum(bool(rows) for rows in engine.removed.values())
    return dict(rounds=rounds, seconds=round(time.perf_counter() - start, 1), joins=joined - 8,
                evicting_sequence_rounds=evictions, recaptures=engine.state.compiled.compiles - made,
                recompiles=sum(counters["recompiles"].values()) - recompiles,
                graphs=engine.state.compiled.compiles)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:tinyllama")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--ticks", type=int, default=64)
    parser.add_argument("--long", type=int, default=2000, help="rounds of the recapture count (0: none)")
    parser.add_argument("--bandwidth", type=float, default=4800.0, help="the device's memory bandwidth, GB/s")
    parser.add_argument("--eager", type=int, nargs="*", default=None,
                        help="the sizes also timed eager (default: the smallest and the largest)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    lm = load_model(args.model, device=device, dtype=dtype)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    config = dict(policy=BrainConfig().policy, budget=args.budget, temperature=0)
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    floor_ms = weights / (args.bandwidth * 1e9) * 1e3
    stamp = time.strftime("%Y-%m-%d %H:%M")
    print(f"model {args.model}  {gpu}  {dtype}  budget {args.budget}  policy {config['policy']}  ticks {args.ticks}  "
          f"torch {torch.__version__}  threads {torch.get_num_threads()}  load {os.getloadavg()[0]:.2f}  {stamp}")
    hf = hf_ms_per_token(lm, [lm.bos_id] + lm.encode(TEXT)[: args.budget + 32], args.ticks)
    eager_sizes = args.eager if args.eager is not None else sorted({min(args.sizes), max(args.sizes)})
    print(f"HF generate: {hf:.2f} ms a token;  weights {weights / 1e9:.2f} GB, floor at {args.bandwidth:.0f} GB/s "
          f"{floor_ms:.3f} ms a round")
    print(f"{'B':>3} {'compiled ms':>11} {'tok/s':>9} {'x floor':>8} {'eager ms':>9} {'x eager':>8} {'x HF':>6}")
    rows, tokens_at = [], {}
    for size in args.sizes:
        ms, tokens = engine_rounds(lm, size, config, args.budget, args.ticks, compiled=True)
        tokens_at[size] = tokens
        eager = engine_rounds(lm, size, config, args.budget, args.ticks, compiled=False)[0] if size in eager_sizes else None
        row = dict(B=size, compiled_ms=round(ms, 3), tok_s=round(size / ms * 1e3, 1), x_floor=round(ms / floor_ms, 1),
                   eager_ms=None if eager is None else round(eager, 3), hf_ratio=round(hf / ms, 2) if size == 1 else None)
        rows.append(row)
        print(f"{size:>3} {ms:>11.2f} {row['tok_s']:>9.1f} {row['x_floor']:>7.1f}x "
              f"{'-' if eager is None else f'{eager:.2f}':>9} {'-' if eager is None else f'{eager / ms:.2f}x':>8} "
              f"{'-' if size != 1 else f'{hf / ms:.1f}x':>6}")
    largest = max(args.sizes)
    checked = min(3, largest)
    alone = []
    for k in range(checked):  # sequence k alone: its own prompt (brains' k-th) in an engine of one
        engine = Engine(lm, slots=1, capacity=args.budget, compiled=True)
        engine.join(k, brain(lm, k, config, args.budget))
        alone.append([engine.step()[k] for _ in range(len(tokens_at[largest][k]))] == tokens_at[largest][k])
    print(f"batched = alone at B = {largest}: {sum(alone)} of {checked} sequences")
    long = long_run(lm, config, args.budget, args.long) if args.long else None
    if long:
        print(f"{long['rounds']} rounds with {long['joins']} joins, {long['evicting_sequence_rounds']} evicting "
              f"sequence-rounds: graphs made after warm-up (recaptures) {long['recaptures']}, recompiles "
              f"{long['recompiles']}, graphs in all {long['graphs']} ({long['seconds']} s)")
    by_size = {row["B"]: row for row in rows}
    figures = dict(date=stamp, gpu=gpu, model=args.model, dtype=dtype,
                   b1_ms_per_token=by_size.get(1, {}).get("compiled_ms"), hf_generate_ms_per_token=round(hf, 3),
                   b64_tok_s=by_size.get(64, {}).get("tok_s"), batched_equal_alone=f"{sum(alone)}/{checked}",
                   recaptures=None if long is None else long["recaptures"], floor_ms=round(floor_ms, 4),
                   policy=config["policy"], budget=args.budget, rows=rows, long_run=long)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
