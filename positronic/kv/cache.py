"""SpliceCache: a transformers `Cache` whose rows can be deleted, inserted and re-rotated.

A `SpliceCache` is a list of layers, one per model layer, in the shape of transformers 5.x
`cache_utils`: the cache picks the layer type once, from the format and the store, and
delegates every operation to its layers (what they share, a scratch, a ring cursor, the rows'
positions, is the layer type's to handle). One module per layer type:

    splice.py  SpliceLayer        float rows in one window of a buffer (the default)
    ring.py    RingLayer          float rows in a ring of slots (store="ring", for streaming)
    packed.py  PackedSpliceLayer  4-bit rows, int4 or fp4 (codecs in formats.py)
    int4h.py   Int4HLayer         4-bit rows with keys before RoPE (kv_format="int4h")

For the model it behaves like a `DynamicCache`: `update()` appends the new rows after the
live ones and returns what attention reads, so a user's own
`model.generate(ids, **with_cache(SpliceCache(model.config, max_cache_len=N)))` works (`with_cache`:
`cache=` or `past_key_values=`, whichever the installed transformers takes).

For the brain it also offers row edits, all in place:
- `splice(kept, length)`: the new row layout after a tick's deletions and insertions, given
  as the runs of surviving rows (old row → new row); `splice_layers` when layers (or their
  kv heads) keep different rows.
- `fill(rows)`: the next forward writes its K/V into these (already live) rows instead of
  appending — how inserted tokens land in the gaps a splice opened.
- `rotate_keys(first, cos, sin)`: re-rotate the keys of rows first.. to new RoPE positions.
- `set_positions`, `set_ring`, `reserve`: what int4h and the ring store need told.
- `saved()`, `load(saved)`: the tensors a session saves for this format, and back.
- `memory_bytes()`, `reset()`, `crop()`.

Only `StateManager` edits a SpliceCache inside the brain; the model only appends.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from transformers.cache_utils import Cache

from positronic.mirror import Ring

from . import formats as kv_formats
from .int4h import Int4HLayer, RowPositions
from .packed import PackedSpliceLayer
from .ring import RingLayer, RingPlan
from .splice import DEFAULT_CAPACITY, OneSequenceLayer, Scratch, SpliceLayer

STORES = ("splice", "ring")

__all__ = ["DEFAULT_CAPACITY", "STORES", "Int4HLayer", "OneSequenceLayer", "PackedSpliceLayer", "RingLayer",
           "RingPlan", "RowPositions", "Scratch", "SpliceCache", "SpliceLayer", "check_store"]


def check_store(store: str) -> str:
    """ValueError unless `store` names a cache store."""
    if store not in STORES:
        raise ValueError(f"unknown kv store {store!r}; choose from {', '.join(STORES)}")
    return store


def make_layers(config, num_layers: int, capacity: int, kv_format: str, store: str, sinks: int,
                key_centres: torch.Tensor | None) -> list[OneSequenceLayer]:
    """The layers of a cache in `kv_format` and `store`: the one place that picks a layer type."""
    codec = kv_formats.packed(kv_format)
    if check_store(store) == "ring":
        if codec is not None:
            raise ValueError(f"the ring store keeps float rows: kv_format {kv_format} needs the splice store")
        return [RingLayer(capacity, sinks) for _ in range(num_layers)]
    if codec is None:
        return [SpliceLayer(capacity) for _ in range(num_layers)]
    if kv_format == "int4h":
        return Int4HLayer.build(config, num_layers, capacity, key_centres)
    return [PackedSpliceLayer(codec, capacity) for _ in range(num_layers)]


class SpliceCache(Cache):
    """A transformers Cache of one layer type: what the model reads and writes, and what
    StateManager splices.

        cache = SpliceCache(model.config, max_cache_len=1024)   # capacity; grows if exceeded
        model.generate(ids, **with_cache(cache), max_new_tokens=32)

    kv_format: "float" (rows in the model's dtype: SpliceLayers), "int4" or "fp4" (4-bit
    codes and a float16 scale per row: PackedSpliceLayers, see kv_formats.py), "int4h"
    (Int4HLayers; `key_centres` [layers, kv_heads, head_dim]: kv_centres.key_centres(lm),
    None for zeros).
    store: "splice" (the default: live rows are one window of the buffer) or "ring" (RingLayers:
    `sinks` rows in fixed slots, the rest wrapping round the buffer, for the streaming
    policy; float rows only).
    """

    def __init__(self, config=None, max_cache_len: int = DEFAULT_CAPACITY, *, num_layers: int | None = None,
                 kv_format: str = "float", store: str = "splice", sinks: int = 0,
                 key_centres: torch.Tensor | None = None):
        if num_layers is None:
            if config is None:
                raise ValueError("SpliceCache needs a model config or num_layers")
            num_layers = config.num_hidden_layers
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        super().__init__(layers=make_layers(config, num_layers, max_cache_len, kv_format, store, sinks, key_centres))
        self.kv_format, self.store = kv_format, store
        self.kind = type(self.layers[0])  # the layer type: what every edit of all layers at once goes to
        # one scratch per dtype the rows are held in, shared by every layer's overlapping moves
        self.part_scratches = self.layers[0].new_scratches()
        self.scratch = self.part_scratches[0]
        for layer in self.layers:
            layer.share_scratch(*self.part_scratches)

    @property
    def rotation_rounds(self) -> bool:
        """Whether re-rotating a key rounds it again (int4, fp4: decoded, rotated, encoded);
        float keys rotate in float32, int4h keys only change position."""
        return self.kind.rotation_rounds

    @property
    def positions(self) -> RowPositions | None:
        """int4h: the RoPE position of every row, shared by the layers; None for other formats."""
        return self.layers[0].positions

    def set_positions(self, positions, *more) -> None:
        """int4h: the RoPE positions of rows 0..n-1 (ints, n >= the live rows; `more` lists
        follow them: rows a forward is about to write after the live ones), read by every layer
        to rotate its keys. Other formats keep keys rotated and need none: a no-op (nothing is
        built)."""
        if self.positions is not None:
            device = self.layers[0].device or "cpu"
            every = list(positions) + [p for extra in more for p in extra]
            self.positions.set(torch.tensor(every, dtype=torch.long, device=device))

    def set_lane_positions(self, positions) -> None:
        """int4h, lanes keeping different rows: the RoPE positions of each lane's rows (ints
        [lanes][rows], lane = layer * kv_heads + head, or one lane per layer for all its kv
        heads), read by each layer to rotate its keys. Other formats: a no-op, as `set_positions`."""
        if self.positions is None:
            return
        layer = self.layers[0]
        held = torch.as_tensor(positions, dtype=torch.long)
        lanes_per_layer = held.shape[0] // len(self.layers)
        if held.dim() != 2 or lanes_per_layer * len(self.layers) != held.shape[0] \
                or lanes_per_layer not in (1, layer.kv_heads):
            raise ValueError(f"lane positions are [lanes, rows] for {len(self.layers)} layers of {layer.kv_heads} "
                             f"kv heads (a lane a layer or a kv head), got {list(held.shape)}")
        self.positions.set_lanes(held.reshape(len(self.layers), lanes_per_layer, -1).to(layer.device or "cpu"))

    @property
    def ring(self) -> Ring | None:
        """The ring store's slot mapping (the same in every layer), or None."""
        return self.layers[0].ring

    def set_ring(self, ring: Ring) -> None:
        """Ring store, empty: lay rows out as `ring` says (the mirror's cursor, on a resume or
        a rebuild)."""
        if self.ring is None:
            raise ValueError(f"the {self.store} store has no ring")
        for layer in self.layers:
            layer.set_ring(ring)

    def reserve(self, length: int) -> None:
        """Room for `length` rows before a forward that appends them, where a layer type must
        make it ahead (a ring: its mask is laid out by slot before the forward); the splice
        store makes room as it goes."""
        self.kind.reserve_all(self.layers, length)

    def slot_rows(self, length: int) -> torch.Tensor | None:
        """Ring store: the row held by each of the slots that `length` rows use (-1: free), what
        the model's attention sees in that order; None for the splice store (slot = row)."""
        return None if self.ring is None else self.layers[0].slot_rows(length)

    def slot_index(self, length: int) -> torch.Tensor | None:
        """Ring store: the slot of each of rows 0..length-1; None for the splice store."""
        return None if self.ring is None else self.layers[0].slot_index(length)

    @property
    def length(self) -> int:
        """Live rows (the same in every layer)."""
        return self.layers[0].length

    def splice(self, kept: list[tuple[int, int, int]], length: int) -> None:
        """Every layer: runs (old_row, new_row, count) of surviving rows move to their new rows;
        the cache then holds `length` rows, the uncovered ones being gaps for `fill`."""
        if not self.layers[0].is_initialized:
            raise ValueError("the cache is empty: nothing to splice")
        self.kind.splice_all(self.layers, kept, length)

    def layer_keys(self, layers: list[int], rows: int) -> torch.Tensor:
        """Keys [len(layers), kv_heads, rows, head_dim] of the first `rows` live rows of `layers`,
        read-only: a view where the layer type holds them together (a Slab), else a copy."""
        return self.kind.keys_of(self.layers, layers, rows)

    def lane_rows(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [layers, kv_heads, n, head_dim] of live rows `rows` (int [lanes, n]: a
        row list per layer, or per kv head of each layer, lane = layer * kv_heads + head)."""
        return self.kind.rows_of(self.layers, np.asarray(rows, dtype=np.int64))

    def put_lane_rows(self, lanes: list[int], rows: list[int], keys: torch.Tensor, values: torch.Tensor,
                      positions: list[int] | None = None) -> None:
        """Write keys / values [n, head_dim] into live row rows[i] of lane lanes[i] alone (lane =
        layer * kv_heads + head): a recalled token's own K/V in the lanes taking it back.
        `positions`: the RoPE position each key is rotated at (int4h stores it before RoPE);
        None: its row's (`set_lane_positions`)."""
        self.kind.put_lanes(self.layers, np.asarray(lanes, dtype=np.int64), np.asarray(rows, dtype=np.int64),
                            keys, values, None if positions is None else np.asarray(positions, dtype=np.int64))

    def splice_layers(self, kept: list[list[tuple[int, int, int]]], length: int) -> None:
        """Layers that keep different rows (a per-layer policy): lane l's runs are kept[l],
        a lane being a layer, or one kv head of a layer (lane = layer * kv_heads + head) when
        heads keep different rows too; every lane then holds `length` rows."""
        self.kind.splice_lanes(self.layers, kept, length)

    @contextlib.contextmanager
    def fill(self, rows: torch.Tensor):
        """Within this block, a forward writes its new K/V into live `rows` (int64 [n],
        ascending) of every layer instead of appending."""
        self.kind.open_rows(self.layers, rows)
        try:
            yield self
        finally:
            self.kind.close_rows(self.layers)

    @property
    def filling(self) -> bool:
        """Inside `fill`: the next forward writes into live rows (running it again writes the
        same rows), not after them."""
        return self.layers[0]._write_rows is not None

    def rotate_keys(self, first: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Every layer: re-rotate the keys of rows first .. first + len(cos)."""
        for layer in self.layers:
            layer.rotate_keys(first, cos, sin)

    def memory_bytes(self) -> int:
        """K/V buffers of every layer (4-bit: codes, scales, zero points), the shared scratch
        buffers, and int4h's row positions."""
        scratch = sum(s.memory_bytes() for s in self.part_scratches)
        held = 0 if self.positions is None else self.positions.memory_bytes()
        return sum(layer.memory_bytes() for layer in self.layers) + scratch + held

    def memory_usage_mb(self) -> float:
        return self.memory_bytes() / 2**20

    # --- what a saved session holds ----------------------------------------------------------

    def saved_parts(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        """name -> (shape, dtype) of each tensor `saved` returns, for `rows` per layer:
        shape (layers, kv_heads, rows, width) with rows left out (the caller knows them)."""
        return {name: ((len(self.layers), kv_heads, width), part_dtype)
                for name, (width, part_dtype) in self.layers[0].saved_parts(head_dim, dtype).items()}

    def saved(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The rows as a session saves them, CPU copies [layers, kv_heads, rows, width] per
        name (`saved_parts`: float, int4, fp4 the rows the model reads, keys and values; int4h
        its parts as stored), in row order (a ring's too)."""
        per_layer = [layer.saved() for layer in self.layers]
        if any(rows is None for rows in per_layer):  # nothing written yet: no rows
            return {name: torch.empty(shape[:2] + (0, shape[2]), dtype=part_dtype)
                    for name, (shape, part_dtype) in self.saved_parts(kv_heads, head_dim, dtype).items()}
        return {name: torch.cat([rows[name] for rows in per_layer]).cpu().contiguous() for name in per_layer[0]}

    def check_saved(self, saved: dict[str, torch.Tensor]) -> None:
        """ValueError if saved rows (of the shapes `saved_parts` gives) hold values this format
        cannot have written."""
        self.kind.check_saved(saved)

    def load(self, saved: dict[str, torch.Tensor], dtype: torch.dtype, device) -> None:
        """Write saved rows ([layers, kv_heads, rows, width] per name of `saved_parts`) into this
        empty cache, each layer's where a forward would (int4h: `set_positions` first)."""
        for index, layer in enumerate(self.layers):
            layer.load({name: tensor[index : index + 1].to(device) for name, tensor in saved.items()}, dtype)
