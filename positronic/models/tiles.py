"""Row-wise layers on a GPU in half precision, computed in tiles of a fixed 64 rows, so that a
row's numbers do not depend on how many rows came with it.

A batched tick feeds B sequences' new tokens as B rows (positronic.batch); a sequence alone
feeds one. On a GPU, cuBLAS picks a product's kernel by its shape (and with the kernel the order
of a dot product's additions: split-K or not, the tile), and torch's reductions (a norm's mean)
pick theirs by the number of rows too. In float32 the batched rows have always kept alone's
tokens on the lent GPUs; in float16, B = 32 chose other tokens than alone on every lent GPU
(bench/results/gpu.md), the last bits of some product or norm differing, and a flat logit row
or a near-tie in an eviction flipping.

`RowTiles` makes every such layer run over exactly `TILE` rows: its input's rows (every dim
but the last, flattened) are padded with zeros up to a multiple of TILE and fed TILE at a time,
so the kernel is the same one whatever the row count, and each row's output is the same bits
alone, in a round of 32 sequences or in a 64-token prompt chunk beside other sequences' rows.
The layers are each family's linear layers (projections, MLP, logits) and norms (RMSNorm,
Qwen3's per-head q/k norms), where each last-dim vector is computed on its own; the rest of a
decoder is elementwise or per sequence (attention; `bench/invariance.py` checks every leaf and
the attention function on a GPU).

A forward of more than `LIMIT` rows (a whole long prompt at once, an evaluation batch) runs
plain, in one product per layer: no such forward is compared with another's rows, and tiling
it would cost a kernel launch per 64 rows per layer. Padding a decode round to 64 rows costs
a GPU little: a product's time there is reading the weights, the same for 1 row or 64.

`use_row_tiles` installs it (the loader does, for CUDA float16 and bfloat16 models); a CPU's
float32 layers are `RowInvariantLinear` (linear.py) instead.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from torch.nn import functional as F

TILE = 64  # rows a product or norm always runs over
LIMIT = 16 * TILE  # more rows than this: one plain call


def by_tiles(function, x: torch.Tensor) -> torch.Tensor:
    """x [..., width] -> function over fixed [TILE, width] tiles of x's rows (all dims but the
    last, flattened; the last tile padded with zeros) -> [..., out], the padding dropped."""
    width = x.shape[-1]
    flat = x.reshape(-1, width).contiguous()  # one layout, so one kernel, whatever x's strides
    rows = flat.shape[0]
    tiles = -(-rows // TILE)
    if tiles * TILE != rows:
        flat = F.pad(flat, (0, 0, 0, tiles * TILE - rows))
    outs = [function(flat[k * TILE : (k + 1) * TILE]) for k in range(tiles)]
    out = outs[0] if tiles == 1 else torch.cat(outs)
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


class RowTiles:
    """Mixin before a row-wise layer's own class (`tiled(cls)`): its forward runs in fixed
    TILE-row tiles (module docstring). Parameters, buffers and state dict stay the layer's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if not rows or rows > LIMIT or x.dim() < 2 or torch.is_grad_enabled() and x.requires_grad:
            return super().forward(x)
        return by_tiles(super().forward, x)

    def untiled(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's own forward, in one call (what it computed before `use_row_tiles`)."""
        return super().forward(x)


@functools.cache
def tiled(cls: type) -> type:
    """`cls` with its forward in tiles: a subclass of RowTiles and cls, made once per class."""
    return type(f"Tiled{cls.__name__}", (RowTiles, cls), {"__module__": __name__, "__doc__": cls.__doc__})


def row_wise(module: nn.Module) -> bool:
    """A layer that computes each last-dim vector of its one input on its own: a plain linear
    layer, or a norm (torch's, or a family's *RMSNorm whose forward takes the hidden states alone)."""
    cls = type(module)
    if cls is nn.Linear or cls in (nn.LayerNorm, nn.RMSNorm):
        return True
    if not cls.__name__.endswith("RMSNorm"):
        return False
    parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    return len(parameters) == 1 and parameters[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                           inspect.Parameter.POSITIONAL_OR_KEYWORD)


def use_row_tiles(model: nn.Module) -> int:
    """Make every row-wise layer of `model` compute in tiles, in place (its class only: the
    parameters stay the same objects, tied ones stay tied). Returns how many layers changed."""
    layers = [module for module in model.modules() if row_wise(module)]
    for module in layers:
        module.__class__ = tiled(type(module))
    return len(layers)
