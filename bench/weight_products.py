"""A decode step's linear layers, kernel by kernel: why int8-weight-only is a loop inductor writes.

    python bench/weight_products.py                          # SmolLM2's 211 shapes, rows 1 2 8
    python bench/weight_products.py --rows 1 2 --kernels loop float32 template

Every product of one decode step of a model of SmolLM2's shape (30 layers of q, k, v, o, gate,
up and down, then the logits: random weights, the shapes are what count) through each kernel, for
a few row counts (a round's slots): milliseconds for all of them, the ratio to the first kernel,
and whether a row's output is the same bits as at the first row count (what batched = alone
needs). Kernels:

    loop      int8 weights, float32 inputs, `weight_only_product` compiled (--weights int8-weight-only)
    float32   F.linear over float32 weights (eager)
    int8pack  torch's `_weight_int8pack_mm` (eager), the same int8 weights and scales
    template  `mm(x, int8.float()) * scale` compiled with max_autotune (inductor's weight-only GEMM)

The int8 ones quantize each output row to 127 levels. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import sys
import time

KERNELS = ("loop", "float32", "int8pack", "template")
# one decoder layer's products (out, in) for SmolLM2-135M, then its logits layer
LAYER = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
LOGITS = (49152, 576)


def shapes(layers: int) -> list[tuple[int, int]]:
    return [*LAYER * layers, LOGITS]


def products(kernel: str, weights: list, int8: list, scales: list):
    """A function of (x576, x1536) -> every product's output, through `kernel`."""
    import torch
    from torch.nn import functional as F

    from positronic.models.weight_only import weight_only_product

    def pick(x576, x1536, inputs):
        return x576 if inputs == 576 else x1536

    if kernel == "float32":
        return lambda a, b: [F.linear(pick(a, b, w.shape[1]), w) for w in weights]
    if kernel == "int8pack":
        return lambda a, b: [torch.ops.aten._weight_int8pack_mm(pick(a, b, q.shape[1]), q, s) for q, s in zip(int8, scales)]
    if kernel == "loop":
        def loop(a, b):
            return [weight_only_product(pick(a, b, q.shape[1]), q, s) for q, s in zip(int8, scales)]
        return torch.compile(loop, fullgraph=True, dynamic=False)

    def template(a, b):
        return [torch.mm(pick(a, b, q.shape[1]), q.t().float()) * s for q, s in zip(int8, scales)]
    return torch.compile(template, fullgraph=True, dynamic=False,
                         options={"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                                  "autotune_num_choices_displayed": 0})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS[:3]), choices=KERNELS)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("rows", "layers", "repeats", "threads"):
        values = getattr(args, name) if name == "rows" else [getattr(args, name)]
        if min(values) < 1:
            parser.error(f"--{name} must be >= 1, got {min(values)}")

    import torch

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inputs, generator=generator) * 0.02 for out, inputs in shapes(args.layers)]
    scales = [w.abs().amax(1) / 127 for w in weights]
    int8 = [torch.round(w / s[:, None]).to(torch.int8) for w, s in zip(weights, scales)]
    x576, x1536 = (torch.randn(max(args.rows), size, generator=generator) for size in (576, 1536))
    print(f"{len(weights)} products of SmolLM2's shapes ({args.layers} layers and the logits), "
          f"{args.threads} threads, medians of {args.repeats}", file=sys.stderr)
    table, first = {}, {}
    for kernel in args.kernels:
        run = products(kernel, weights, int8, scales)
        for rows in args.rows:
            a, b = x576[:rows].clone(), x1536[:rows].clone()
            with torch.no_grad():
                for _ in range(2):  # a compile, then a warm call
                    out = run(a, b)
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    run(a, b)
                    times.append(time.perf_counter() - start)
            row0 = torch.cat([o[0] for o in out])
            same = torch.equal(row0, first.setdefault(kernel, row0))
            table[kernel, rows] = (sorted(times)[len(times) // 2] * 1e3, same)
            print(f"{kernel}, {rows} rows: {table[kernel, rows][0]:.2f} ms", file=sys.stderr, flush=True)
    base = args.kernels[0]
    print(f"| kernel | rows | ms (all {len(weights)} products) | × {base} | a row's bits as at {args.rows[0]} row(s) |")
    print("|---|---|---|---|---|")
    for (kernel, rows), (ms, same) in table.items():
        print(f"| {kernel} | {rows} | {ms:.2f} | {ms / table[base, rows][0]:.2f} | {'same' if same else 'moved'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
