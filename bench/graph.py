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
the largest B's slots with sequences joining and leaving at random (more active than the next
smaller bucket holds: the bucket the table made, so no compile is added on a GPU, where each takes ~30 s),
counting graphs made after the warm-up (a recapture each on a GPU; 0 is the promise) and
dynamo's recompiles. The smallest and largest B, batched = alone and the long run come first
and the figures are written after each stage, so a run cut off by its time limit keeps them.

Prints a table and, with `--json`, writes the figures issue 70 names (date, gpu, model, dtype,
b1_ms_per_token, hf_generate_ms_per_token, b64_tok_s, batched_equal_alone, recaptures) plus the
whole table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.batch import TEXT, brain, brains  # noqa: E402  (bench/batch.py: the same prompts)
from bench.decode import default_model  # noqa: E402

from positronic.batch.engine import Engine  # noqa: E402
from positronic.batch.plain import PRELUDES  # noqa: E402
from positronic.brain.loop import BrainConfig  # noqa: E402
from positronic.models import load_model  # noqa: E402
from positronic.models.compiled import buckets  # noqa: E402
from positronic.state.plain import SETTLES  # noqa: E402


def sync(lm) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize()


def hf_ms_per_token(lm, prompt: list[int], ticks: int) -> float:
    """Greedy `generate` of `ticks` + 1 tokens against 1 token: ms a decode step, on the same
    weights in a model built transformers' default way ("sdpa" attention; bench/decode.py's
    `default_model`), not on the brain's model object."""
    model = default_model(lm)
    ids = torch.tensor([prompt], device=lm.device)
    times = {}
    for new in (1, ticks + 1, 1, ticks + 1):  # the first pair warms up
        sync(lm)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        sync(lm)
        times[new] = time.perf_counter() - start
    return (times[ticks + 1] - times[1]) / ticks * 1e3


def engine_rounds(lm, size: int, config: dict, budget: int, ticks: int, compiled: bool, warm: int = 3):
    """ms a round of `size` sequences (after `warm` rounds), and each sequence's tokens."""
    engine = Engine(lm, slots=size, capacity=budget, compiled=compiled)
    for k, started in enumerate(brains(lm, size, config, budget)):
        engine.join(k, started)
    tokens = [[] for _ in range(size)]
    # warm-up until a plain round has run too: this bucket's graphs, the plain rounds' prelude and
    # writes included, are made before the clock (`Engine.warm` would make every bucket's: minutes on a GPU)
    while engine.rounds < warm or (engine.plain and not engine.plain_made and engine.rounds < 64):
        for k, token in engine.step().items():
            tokens[k].append(token)
    sync(lm)
    start = time.perf_counter()
    for _ in range(ticks):
        for k, token in engine.step().items():  # the tokens come back to the host: a sync each round
            tokens[k].append(token)
    return (time.perf_counter() - start) / ticks * 1e3, tokens


def cudagraph_counts() -> dict:
    """Inductor's counters of CUDA graphs (skips name why a graph was not captured: the rounds
    then run its kernels one by one)."""
    from torch._dynamo.utils import counters

    return {name: count for name, count in counters["inductor"].items() if "cudagraph" in name}


def long_run(lm, config: dict, budget: int, rounds: int, slots: int) -> dict:
    """Graphs made over `rounds` rounds of an engine of `slots` (the largest B, whose bucket is
    made already) with sequences joining and leaving so that more sequences stay active than the
    next smaller bucket holds (the one bucket: no compile beyond the table's), every sequence
    past its budget."""
    from torch._dynamo.utils import counters

    engine = Engine(lm, slots=slots, capacity=budget, compiled=True)
    for k, started in enumerate(brains(lm, slots, config, budget)):
        engine.join(k, started)
    engine.step()
    made, recompiles = graphs(engine), sum(counters["recompiles"].values())
    sizes = buckets(slots)  # active above the next smaller bucket: the slots' bucket alone
    rng, joined, left, evictions, floor = random.Random(0), slots, 0, 0, (sizes[-2] + 1 if len(sizes) > 1 else 1)
    start = time.perf_counter()
    for _ in range(rounds):
        if len(engine) < slots and rng.random() < 0.3:
            engine.join(joined, brain(lm, joined % 16, config, budget))
            joined += 1
        elif len(engine) > floor and rng.random() < 0.3:
            engine.leave(rng.choice(engine.keys()))
            left += 1
        engine.step()
        evictions += sum(bool(rows) for rows in engine.removed.values())
    return dict(rounds=rounds, slots=slots, seconds=round(time.perf_counter() - start, 1), joins=joined - slots,
                leaves=left, evicting_sequence_rounds=evictions, plain_rounds=engine.plain_made,
                recaptures=graphs(engine) - made, recompiles=sum(counters["recompiles"].values()) - recompiles,
                graphs=graphs(engine))


def graphs(engine: Engine) -> int:
    """Graphs made so far for the engine's rounds: the forward's, and a plain round's prelude and writes."""
    return engine.state.compiled.compiles + PRELUDES.compiles + SETTLES.compiles


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
    logging.basicConfig(format="  %(message)s")  # each bucket's compile and its seconds
    logging.getLogger("positronic.models.compiled").setLevel(logging.INFO)
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
    rows, tokens_at, alone, checked, long = [], {}, [], 0, None
    began = time.perf_counter()

    def write(stage: str) -> None:
        """The figures so far, after every stage: a run cut off by its time limit keeps them."""
        by_size = {row["B"]: row for row in rows}
        figures = dict(date=stamp, gpu=gpu, model=args.model, dtype=dtype,
                       b1_ms_per_token=by_size.get(1, {}).get("compiled_ms"), hf_generate_ms_per_token=round(hf, 3),
                       b64_tok_s=by_size.get(64, {}).get("tok_s"),
                       batched_equal_alone=f"{sum(alone)}/{checked}" if checked else None,
                       recaptures=None if long is None else long["recaptures"], floor_ms=round(floor_ms, 4),
                       policy=config["policy"], budget=args.budget, rows=rows, long_run=long,
                       cudagraphs=cudagraph_counts(), complete=stage == "done", stage=stage)
        print(f"  [{time.perf_counter() - began:.0f} s: {stage}]", flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")

    def measure(size: int) -> None:
        ms, tokens = engine_rounds(lm, size, config, args.budget, args.ticks, compiled=True)
        tokens_at[size] = tokens
        eager = engine_rounds(lm, size, config, args.budget, args.ticks, compiled=False)[0] if size in eager_sizes else None
        row = dict(B=size, compiled_ms=round(ms, 3), tok_s=round(size / ms * 1e3, 1), x_floor=round(ms / floor_ms, 1),
                   eager_ms=None if eager is None else round(eager, 3), hf_ratio=round(hf / ms, 2) if size == 1 else None)
        rows.append(row)
        print(f"{size:>3} {ms:>11.2f} {row['tok_s']:>9.1f} {row['x_floor']:>7.1f}x "
              f"{'-' if eager is None else f'{eager:.2f}':>9} {'-' if eager is None else f'{eager / ms:.2f}x':>8} "
              f"{'-' if size != 1 else f'{hf / ms:.1f}x':>6}")
        write(f"B = {size}")

    # the figures first (the smallest and largest B, batched = alone, recaptures), the
    # sizes between last: a run its time limit cuts off has written what matters most
    smallest, largest = min(args.sizes), max(args.sizes)
    for size in sorted({smallest, largest}):
        measure(size)
    checked = min(3, largest)
    for k in range(checked):  # sequence k alone: its own prompt (brains' k-th) in an engine of one
        engine = Engine(lm, slots=1, capacity=args.budget, compiled=True)
        engine.join(k, brain(lm, k, config, args.budget))
        alone.append([engine.step()[k] for _ in range(len(tokens_at[largest][k]))] == tokens_at[largest][k])
    print(f"batched = alone at B = {largest}: {sum(alone)} of {checked} sequences")
    write("batched = alone")
    long = long_run(lm, config, args.budget, args.long, largest) if args.long else None
    if long:
        print(f"{long['rounds']} rounds of {long['slots']} slots with {long['joins']} joins, {long['leaves']} leaves, "
              f"{long['evicting_sequence_rounds']} evicting "
              f"sequence-rounds: graphs made after warm-up (recaptures) {long['recaptures']}, recompiles "
              f"{long['recompiles']}, graphs in all {long['graphs']} ({long['seconds']} s)")
        write("recaptures")
    for size in sorted(set(args.sizes) - {smallest, largest}):
        measure(size)
    rows.sort(key=lambda row: row["B"])
    print(f"inductor's CUDA graphs: {cudagraph_counts()}")
    write("done")
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
