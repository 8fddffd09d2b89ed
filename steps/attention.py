"""Step 2a: one attention score per live row from the newest query's attention."""
from __future__ import annotations

from typing import Literal, Sequence

from torch import Tensor

LayerSpec = Literal["last", "all"] | Sequence[int]


def scores(attention: Tensor, layers: LayerSpec = "last") -> list[float]:
    """Score each live row: mean over heads, then mean over the selected layers.

    attention: [layers, heads, live], the newest query's attention over all live rows.
    layers: "last", "all", or a non-empty sequence of distinct layer indices
    (negative counts from the end, -1 = last).
    Returns `live` floats (a plain list: brightness is kept in a pure-Python mirror).
    """
    if not isinstance(attention, Tensor) or attention.dim() != 3:
        raise ValueError("attention must be a 3-D tensor [layers, heads, live]")
    n_layers, n_heads, _ = attention.shape
    if n_layers == 0 or n_heads == 0:
        raise ValueError(f"attention needs at least one layer and head, got shape {tuple(attention.shape)}")
    chosen = layer_indices(layers, n_layers)
    # float32 so float16 rows of thousands of tiny weights do not lose precision in the mean.
    return attention[chosen].float().mean(dim=(0, 1)).tolist()


def layer_indices(layers: LayerSpec, n_layers: int) -> list[int]:
    """Resolve a layer spec to non-negative layer indices; ValueError if it is invalid."""
    if isinstance(layers, str):
        if layers == "last":
            return [n_layers - 1]
        if layers == "all":
            return list(range(n_layers))
        raise ValueError(f'layers must be "last", "all" or a sequence of ints, got {layers!r}')
    if not isinstance(layers, Sequence) or len(layers) == 0:
        raise ValueError(f"layers must be a non-empty sequence of ints, got {layers!r}")
    out = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"layers must contain ints, got {i!r}")
        if not -n_layers <= i < n_layers:
            raise ValueError(f"layer {i} out of range for {n_layers} layers")
        out.append(i % n_layers)
    if len(set(out)) != len(out):
        # A repeated layer would silently count twice in the mean.
        raise ValueError(f"layers must be distinct, got {list(layers)!r}")
    return out
