"""Which of a model's modules give a row other bits among B rows than alone: where a batched
tick can leave "exactly what running alone gives".

    python bench/invariance.py [--model random:tinyllama] [--device cuda] [--dtypes float16 float32]
                               [--rows 8 32]

A batched forward (positronic.batch) packs B sequences' new tokens into one row of the batch
([1, B]), so every linear layer, norm and activation runs over B rows where a sequence alone
runs over one; only attention stays per sequence (its query a slice of the packed one, over its
own keys). If a kernel picks another algorithm by row count (a split reduction, another GEMM
tiling), the sequence's numbers change in the last bits, and a near-tie in greedy decoding or an
eviction can flip. On a GPU in float16, B = 32 chose other tokens than alone on every lent GPU
(bench/results/gpu.md), and no run said which module was the cause; this finds it.

One packed forward of B random tokens records what every leaf module (no children, one tensor
in: linear layers, norms, activations, the embedding) received. Then each module runs again
on each row alone (a contiguous copy, as a sequence alone feeds it) and on all B rows, and the
row's outputs are compared bit for bit. The attention function gets the same check with a
random query, keys and values of the model's shapes: a packed query's slice against that row's
query alone, over the same keys. Modules of the same kind and shape are one line (a 22-layer
model has ~10 lines). Exit status 1 when any row differs anywhere. Where the loader tiled a
layer (a GPU's float16 and bfloat16 linear layers and norms run in fixed 64-row tiles:
positronic/models/tiles.py), a second line checks the layer's own forward untiled, so one run
shows both the cause and that the tiles remove it.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic.models import ModelError, load_model  # noqa: E402
from positronic.models.attention import for_device  # noqa: E402
from positronic.models.tiles import RowTiles  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

KEY_ROWS = 256  # cache rows the attention check attends over


def leaf_inputs(model: nn.Module, token_ids: torch.Tensor) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """name -> (module, the tensor it received) for every leaf module that took one tensor in one
    packed forward of `token_ids` [1, rows] (positions 0, no cache)."""
    seen: dict[str, tuple[nn.Module, torch.Tensor]] = {}
    hooks = []
    for name, module in model.named_modules():
        if next(module.children(), None) is not None:
            continue

        def hook(module, args, kwargs, output, name=name):
            if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and name not in seen:
                seen[name] = (module, args[0].detach().clone())

        hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=token_ids, position_ids=torch.zeros_like(token_ids), use_cache=False)
    finally:
        for handle in hooks:
            handle.remove()
    return seen


def row_differences(module, packed: torch.Tensor) -> tuple[int, float]:
    """packed [1, rows, ...] (the rows on dim 1) -> (rows whose output alone differs in any bit
    from their output among all rows, the largest absolute difference)."""
    with torch.no_grad():
        together = module(packed)
        differing, largest = 0, 0.0
        for row in range(packed.shape[1]):
            alone = module(packed[:, row : row + 1].contiguous())
            mine = together[:, row : row + 1]
            if not torch.equal(alone, mine):
                differing += 1
                largest = max(largest, (alone.double() - mine.double()).abs().max().item())
    return differing, largest


def attention_differences(lm, rows: int, generator: torch.Generator) -> tuple[int, float]:
    """As row_differences, for the attention function the model runs on its device: each row's
    query sliced from a packed [1, heads, rows, head_dim] one (as a batched forward hands a
    sequence its queries) against the same query made alone, over the same keys and values."""
    module = next(m for m in lm.model.modules() if hasattr(m, "num_key_value_groups"))
    config = lm.model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kind = dict(dtype=lm.dtype, device=lm.device)
    flat = torch.randn(1, rows, heads * head_dim, generator=generator).to(**kind)
    keys = torch.randn(1, kv_heads, KEY_ROWS, head_dim, generator=generator).to(**kind)
    values = torch.randn(1, kv_heads, KEY_ROWS, head_dim, generator=generator).to(**kind)
    attend = ALL_ATTENTION_FUNCTIONS[for_device(lm.device)]
    packed = flat.view(1, rows, heads, head_dim).transpose(1, 2)
    differing, largest = 0, 0.0
    with torch.no_grad():
        for row in range(rows):
            alone = flat[:, row : row + 1].contiguous().view(1, 1, heads, head_dim).transpose(1, 2)
            one = attend(module, alone, keys, values, None, scaling=module.scaling)[0]
            sliced = attend(module, packed[:, :, row : row + 1], keys, values, None, scaling=module.scaling)[0]
            if not torch.equal(one, sliced):
                differing += 1
                largest = max(largest, (one.double() - sliced.double()).abs().max().item())
    return differing, largest


def shape_of(module: nn.Module, received: torch.Tensor) -> str:
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear):
        return f"{module.in_features}->{module.out_features}"
    if isinstance(module, nn.Embedding):
        return f"{module.num_embeddings}x{module.embedding_dim}"
    if isinstance(weight, torch.Tensor):
        return "x".join(map(str, weight.shape))
    return "x".join(map(str, received.shape[2:])) or "-"


def check(lm, rows: int, seed: int = 0) -> list[tuple[str, str, int, int, float, bool]]:
    """(kind, shape, modules, modules with a differing row, largest difference, whether the
    model runs it) per kind and shape of leaf module, in the order the forward first ran them,
    then the attention function's line. A layer the loader tiled (a GPU's half-precision
    layers, positronic/models/tiles.py) gets a second line, "<class>(untiled)", for its own
    forward in one call: what the model would run without the tiles, not counted as a finding."""
    generator = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(3, lm.vocab_size, (1, rows), generator=generator).to(lm.device)
    lines: dict[tuple[str, str, bool], list] = defaultdict(lambda: [0, 0, 0.0])

    def record(kind: str, shape: str, runs: bool, function, received) -> None:
        differing, largest = row_differences(function, received)
        line = lines[(kind, shape, runs)]
        line[0] += 1
        line[1] += bool(differing)
        line[2] = max(line[2], largest)

    for module, received in leaf_inputs(lm.model, token_ids).values():
        if received.dim() < 2 or received.shape[1] != rows:
            continue  # not one row per token on dim 1 (nothing of a decoder's stack, but say nothing of it)
        shape = shape_of(module, received)
        record(type(module).__name__, shape, True, module, received)
        if isinstance(module, RowTiles):
            record(f"{type(module).__name__.removeprefix('Tiled')}(untiled)", shape, False, module.untiled, received)
    differing, largest = attention_differences(lm, rows, generator)
    attention_line = ("attention function", for_device(lm.device), 1, int(bool(differing)), largest, True)
    return [(kind, shape, count, bad, largest, runs) for (kind, shape, runs), (count, bad, largest) in lines.items()] \
        + [attention_line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tinyllama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[8], help="sequences packed in one forward (B)")
    args = parser.parse_args(argv)
    if any(rows < 2 for rows in args.rows):
        parser.error("--rows: at least 2 (one row is what alone means)")
    found = False
    for dtype in args.dtypes:
        try:
            lm = load_model(args.model, device=args.device, dtype=dtype)
        except (ModelError, ValueError) as error:
            parser.error(str(error))
        print(f"model {args.model}  {lm.device}  {dtype}  torch {torch.__version__}"
              + (f"  {torch.cuda.get_device_name()}" if lm.device.type == "cuda" else ""))
        print(f"{'module':<22} {'shape':<22} {'rows':>4} {'modules':>7} {'differ':>6}  {'max |diff|':>10}")
        for rows in args.rows:
            for kind, shape, count, bad, largest, runs in check(lm, rows):
                found |= bool(bad) and runs
                print(f"{kind[:22]:<22} {shape[:22]:<22} {rows:>4} {count:>7} {bad:>6}  {largest:>10.3g}"
                      + ("" if not bad else "   DIFFERS" if runs else "   (not run: the tiles keep it)"))
        del lm
    print("every row: the same bits alone as among the others" if not found
          else "DIFFERS: those modules give a row other bits among other rows than alone")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
