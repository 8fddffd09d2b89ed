"""SpliceLayer: one layer's K/V rows in a preallocated buffer, with room on both sides.

Each layer owns a K/V buffer and a window `[start, start + length)` of live rows in it:

    key_buffer, value_buffer: [batch=1, kv_heads, capacity, head_dim]
    keys, values (live views): [1, kv_heads, length, head_dim]

For the model it behaves like a `DynamicCache` layer: `update()` appends the new rows after
the live ones (written with `index_copy_`) and returns the live views. For the brain it also
takes row edits, all in place:
- `splice(kept, length)`: the new row layout after a tick's deletions and insertions, given
  as the runs of surviving rows (old row → new row). The longest run stays where it is and
  the others move, so an edit near either end moves only the rows on that side.
- `splice_heads(layers, kept, length)`: the same on every layer, each kv head keeping its own
  rows; all layers' rows move in one copy, the layers' buffers being views of one Slab.
- `_write_rows` (set by `SpliceCache.fill`): the next forward writes its K/V into these
  (already live) rows instead of appending — how inserted tokens land in the gaps a splice
  opened.
- `rotate_keys(first, cos, sin)`: re-rotate the keys of rows first.. to new RoPE positions.
- `memory_bytes()`, `reset()`, `crop()`.

Overlapping moves go through a `Scratch` every layer of the cache shares. `OneSequenceLayer`
is what every layer type of this package (and SmartKV's) shares, including the operations a
`SpliceCache` runs on all its layers at once.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from . import buffers, rope
from .slab import Slab

DEFAULT_CAPACITY = 256


def check_rows(key_states: torch.Tensor, value_states: torch.Tensor, kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: torch.device) -> None:
    """ValueError unless new keys and values are [1, kv_heads, n, head_dim] of the cache's
    dtype and device, as many of each."""
    for name, rows in (("keys", key_states), ("values", value_states)):
        if rows.dim() != 4 or (rows.shape[0], rows.shape[1], rows.shape[3]) != (1, kv_heads, head_dim):
            raise ValueError(f"new {name} have shape {list(rows.shape)}; this cache takes "
                             f"[1, {kv_heads}, n, {head_dim}]")
        if rows.dtype != dtype or rows.device != device:
            raise ValueError(f"new {name} are {rows.dtype} on {rows.device}; the cache holds {dtype} on {device}")
    if key_states.shape[2] != value_states.shape[2]:
        raise ValueError(f"{key_states.shape[2]} new key rows but {value_states.shape[2]} value rows")


class OneSequenceLayer(CacheLayerMixin):
    """What every layer of this project's caches shares: one sequence (batch 1, no beam
    search), `length` live rows, growth without a fixed maximum, `crop` from the end."""

    cache_name = "SpliceCache"  # named in the refusals
    length: int

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New float K/V buffers of `capacity` rows (or slots) shaped like the first rows
        (a packed layer keeps its rows in parts and overrides this)."""
        if key_states.shape[0] != 1:
            raise ValueError(f"SpliceCache holds one sequence; got a batch of {key_states.shape[0]}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buffer = buffers.rows_like(key_states, self.capacity)
        self.value_buffer = buffers.rows_like(value_states, self.capacity)
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows when full

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of rows to remove from the end")
        self.length = max(0, self.length + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{self.cache_name} holds one sequence; beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError(f"{self.cache_name} holds one sequence; it cannot be repeated over a batch")

    # --- what a SpliceCache of layers of one type does to all of them at once ---------------
    # (the cache picks the type once and delegates; a type overrides what its layers share)

    rotation_rounds = False  # whether re-rotating a key rounds it again (decoded, rotated, encoded)
    positions = None  # the RowPositions the layers share, where they read keys at positions
    ring = None  # the Ring the layers share, for a ring store

    def new_scratches(self) -> list[Scratch]:
        """The scratches every layer of the cache shares (one per dtype the rows are held in)."""
        return [Scratch()]

    def share_scratch(self, *scratches: Scratch) -> None:
        """Take the cache's shared scratches (`new_scratches` of its first layer)."""

    @classmethod
    def splice_all(cls, layers: list, kept: list[tuple[int, int, int]], length: int) -> None:
        """`splice(kept, length)` on every layer."""
        for layer in layers:
            layer.splice(kept, length)

    @classmethod
    def splice_lanes(cls, layers: list, kept: list[list[tuple[int, int, int]]], length: int) -> None:
        """Layers that keep different rows: lane l's runs are kept[l], a lane being a layer, or
        one kv head of a layer (lane = layer * kv_heads + head, `splice_heads`)."""
        if not layers[0].is_initialized:
            raise ValueError("the cache is empty: nothing to splice")
        heads = layers[0].kv_heads
        if len(kept) not in (len(layers), len(layers) * heads):
            raise ValueError(f"{len(kept)} run lists for {len(layers)} layers of {heads} kv heads")
        if len(kept) == len(layers):
            cls.splice_layer_lanes(layers, kept, length)
            return
        cls.splice_heads(layers, kept, length)

    @classmethod
    def splice_layer_lanes(cls, layers: list, kept: list[list[tuple[int, int, int]]], length: int) -> None:
        """Lanes that are whole layers (or a model of one kv head): layer by layer."""
        for layer, runs in zip(layers, kept):
            layer.splice(runs, length)

    @classmethod
    def open_rows(cls, layers: list, rows: torch.Tensor) -> None:
        """The next forward writes into live `rows` (int64 [n]) of every layer (SpliceCache.fill)."""
        for layer in layers:
            layer._write_rows = rows

    @classmethod
    def close_rows(cls, layers: list) -> None:
        """The forward is done: appends again."""
        for layer in layers:
            layer._write_rows = None

    @classmethod
    def keys_of(cls, layers: list, index: list[int], rows: int) -> torch.Tensor:
        """The keys of the first `rows` live rows of layers `index`: [len(index), kv_heads, rows,
        head_dim] (a copy: each layer's rows lie in a buffer of its own)."""
        return torch.stack([layers[i].keys[0, :, :rows] for i in index])

    @classmethod
    def rows_of(cls, layers: list, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [layers, kv_heads, n, head_dim] of live rows `rows` (int [lanes, n]:
        one row list per layer, or per kv head of each layer, lane = layer * kv_heads + head)."""
        if (rows == rows[0]).all():  # the same rows in every lane: one index, one read a layer
            at = torch.from_numpy(rows[0]).to(layers[0].device)
            return (torch.stack([layer.keys[0][:, at] for layer in layers]),  # indexing: half index_select's time
                    torch.stack([layer.values[0][:, at] for layer in layers]))
        heads = len(rows) // len(layers)
        keys, values = [], []
        for index, layer in enumerate(layers):
            at = [torch.from_numpy(rows[index * heads + head]).to(layer.device) for head in range(heads)]
            if heads == 1:
                keys.append(layer.keys[0][:, at[0]])
                values.append(layer.values[0][:, at[0]])
                continue
            keys.append(torch.cat([layer.keys[0, head : head + 1][:, a] for head, a in enumerate(at)]))
            values.append(torch.cat([layer.values[0, head : head + 1][:, a] for head, a in enumerate(at)]))
        return torch.stack(keys), torch.stack(values)

    @classmethod
    def reserve_all(cls, layers: list, length: int) -> None:
        """Room for `length` rows before a forward appends them: nothing to do ahead, a layer
        that is not a ring makes room as it goes."""

    # --- what a saved session holds --------------------------------------------------------

    def saved_parts(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        """name -> (width, dtype) of each tensor [1, kv_heads, rows, width] `saved` returns:
        here the live rows as the model reads them."""
        return {"keys": (head_dim, dtype), "values": (head_dim, dtype)}

    def saved(self) -> dict[str, torch.Tensor] | None:
        """This layer's live rows as a session saves them (`saved_parts`), in row order; None
        while it holds no buffer."""
        return None if not self.is_initialized else {"keys": self.keys, "values": self.values}

    def load(self, saved: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Append rows `saved` gave (each [1, kv_heads, rows, width], on the layer's device) to
        this empty layer, where the model's own forward would have written them."""
        self.update(saved["keys"], saved["values"])

    @classmethod
    def check_saved(cls, saved: dict[str, torch.Tensor]) -> None:
        """ValueError if saved rows (shapes and dtypes already checked) hold values this layer
        type could not have written."""


class SpliceLayer(OneSequenceLayer):
    """One layer's K/V rows in a preallocated buffer, with room on both sides of the live rows."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        # CacheLayerMixin.__init__ would assign `keys`/`values`, which are views here.
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self.start = 0
        self.length = 0
        self.is_initialized = False
        self._write_rows: torch.Tensor | None = None  # live rows the next update() fills
        self.slab: Slab | None = None  # the Slab this layer's buffers are views of, once lanes are spliced
        self.scratch = Scratch()  # SpliceCache gives all its layers one shared scratch

    # --- what the model sees ---------------------------------------------------------------

    @property
    def keys(self) -> torch.Tensor | None:
        """Live keys [1, kv_heads, length, head_dim] (a view of the buffer)."""
        return None if self.key_buffer is None else self.key_buffer[:, :, self.start : self.start + self.length]

    @property
    def values(self) -> torch.Tensor | None:
        """Live values [1, kv_heads, length, head_dim] (a view of the buffer)."""
        return None if self.value_buffer is None else self.value_buffer[:, :, self.start : self.start + self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new rows [1, kv_heads, n, head_dim]: into the rows `fill()` named, or after
        the live rows. Returns the live keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_rows(key_states, value_states)
        count = key_states.shape[-2]
        if (rows := self._write_rows) is not None:
            if rows.shape[0] != count:  # not len(): a Python call, and this runs per layer per sequence
                raise ValueError(f"the forward brought {count} rows for {rows.shape[0]} open slots")
            where = rows + self.start if self.start else rows
        else:
            self.reserve(self.length + count)
            where = torch.arange(self.start + self.length, self.start + self.length + count, device=self.device)
            self.length += count
        self.key_buffer.index_copy_(2, where, key_states)
        self.value_buffer.index_copy_(2, where, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def reset(self) -> None:
        """Drop every row; the buffer is kept for reuse."""
        self.start = self.length = 0
        self._write_rows = None

    # --- row edits -------------------------------------------------------------------------

    def reserve(self, length: int) -> None:
        """Make sure rows [start, start + length) fit: pack the live rows down to buffer row 0
        when the end is reached, and double the buffer only when that is not enough."""
        if self.start + length <= self.capacity:
            return
        if length <= self.capacity:
            self._move(self.start, 0, self.length)
            self.start = 0
            return
        self._grow(length, [(0, 0, self.length)], self.length)

    def splice(self, kept: list[tuple[int, int, int]], length: int) -> None:
        """Rearrange the live rows: each run (old_row, new_row, count) of surviving rows moves
        to its new row; rows not covered are the gaps a following `fill` forward writes.
        Runs are in order and do not overlap, before or after."""
        if length > self.capacity:
            self._grow(length, kept, length)
            return
        new_start = self._anchor(kept, length)
        moves = [(self.start + old, new_start + new, count) for old, new, count in kept
                 if self.start + old != new_start + new]
        # Runs keep their order, so moving the left-going runs from the left and the
        # right-going ones from the right never overwrites a run not yet moved.
        for src, dst, count in [m for m in moves if m[1] < m[0]]:
            self._move(src, dst, count)
        for src, dst, count in reversed([m for m in moves if m[1] > m[0]]):
            self._move(src, dst, count)
        self.start, self.length = new_start, length

    @classmethod
    def keys_of(cls, layers: list, index: list[int], rows: int) -> torch.Tensor:
        """As OneSequenceLayer's, but a view, not a copy, of every layer's keys when they all
        live in one Slab at the same start (after per-lane splices)."""
        slab = layers[0].slab
        if slab is not None and list(index) == list(range(len(layers))):
            keys = slab.keys_of(layers, rows)
            if keys is not None:
                return keys
        return super().keys_of(layers, index, rows)

    @classmethod
    def rows_of(cls, layers: list, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """As OneSequenceLayer's, in one gather per buffer when the layers share a Slab and a start."""
        slab = layers[0].slab
        read = slab.rows_of(layers, rows) if slab is not None else None
        return read if read is not None else super().rows_of(layers, rows)

    @classmethod
    def splice_layer_lanes(cls, layers: list, kept: list[list[tuple[int, int, int]]], length: int) -> None:
        """A lane that is a whole layer moves as its kv heads would, all alike: every layer's rows
        move in the Slab at once, as a per-head policy's do, and later reads of every layer's
        keys or rows are one view or one gather."""
        heads = layers[0].kv_heads
        cls.splice_heads(layers, [runs for runs in kept for _ in range(heads)], length)

    @classmethod
    def splice_heads(cls, layers: list, kept: list[list[tuple[int, int, int]]], length: int) -> None:
        """Each kv head of each layer keeps its own rows (a per-head policy): lane l = layer *
        kv_heads + head keeps the runs kept[l], as in `splice`, and then holds `length` rows.
        The rows of every lane move at once, in the Slab the layers share (slab.py), and every
        layer's live rows start at the same buffer row afterwards (`Slab.keys_of` then reads
        all layers' keys as one view)."""
        slab = Slab.holding(layers, length)
        anchor, moves = cls.lane_moves(layers, kept, length)
        for layer in layers:
            layer.start, layer.length = anchor, length
        slab.move(*moves)

    @staticmethod
    def lane_moves(layers: list, kept: list[list[tuple[int, int, int]]], length: int) -> tuple[int, tuple]:
        """The plan of `splice_heads` (the rows fit the capacity), not done: the anchor all
        layers share (their new `start`) and the moves: int64 arrays lane, src, dst, count
        [moves] (rows src .. src + count of a lane go to dst .., in buffer rows).

        The anchor is the buffer row of new row 0 that leaves the fewest rows to move over all
        lanes: a dropped memory row lies in the older part, so usually the rows before it move
        up one and the live rows creep towards the buffer's end, one row a tick. When that
        anchor has no room left, every row is packed down to row 0 at once: the next
        capacity - length ticks creep again, where anchoring in place would move every row
        after each lane's drop (most of the rows) on every tick from then on."""
        heads = len(kept) // len(layers)
        runs = np.array([(lane, layers[lane // heads].start + old, new, count) for lane, lane_runs in enumerate(kept)
                         for old, new, count in lane_runs if count > 0], dtype=np.int64).reshape(-1, 4)
        lane, src, new, count = runs.T
        starts = {layer.start for layer in layers}
        candidates = sorted(starts | {int(a) for a in np.unique(src - new)} if len(runs) else starts)
        candidates = [a for a in candidates if a >= 0]
        moved = [int(count[src != a + new].sum()) for a in candidates]
        anchor = min(zip(moved, (a not in starts for a in candidates), candidates))[2]
        if anchor + length > layers[0].capacity:
            anchor = 0
        moving = src != anchor + new
        return anchor, (lane[moving], src[moving], anchor + new[moving], count[moving])

    @classmethod
    def put_lanes(cls, layers: list, lanes: np.ndarray, rows: np.ndarray, keys: torch.Tensor,
                  values: torch.Tensor, positions: np.ndarray | None = None) -> None:
        """Write keys / values [n, head_dim] into live row rows[i] of lane lanes[i] (lane = layer
        * kv_heads + head): recalled rows that some lanes take back and others not. One copy
        per buffer when the layers share a Slab and a start, else one per layer written.
        `positions` (where each key is rotated) is for layer types that store keys before
        RoPE: float keys are stored as given, and a moved row is re-rotated by the state."""
        slab = layers[0].slab
        if slab is not None and slab.put(layers, lanes, rows, keys, values):
            return
        heads = layers[0].kv_heads
        for index in np.unique(lanes // heads).tolist():
            mine = np.flatnonzero(lanes // heads == index)
            layer = layers[index]
            capacity = layer.key_buffer.shape[2]
            at = torch.from_numpy((lanes[mine] % heads) * capacity + layer.start + rows[mine]).to(keys.device)
            pick = torch.from_numpy(mine).to(keys.device)
            for buffer, given in ((layer.key_buffer, keys), (layer.value_buffer, values)):
                buffer.view(-1, buffer.shape[-1]).index_copy_(0, at, given[pick].to(buffer.dtype))  # [heads * capacity, d]

    def rotate_keys(self, first: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Re-rotate the keys of live rows first .. first + rows by cos/sin [rows, head_dim], or
        [kv_heads, rows, head_dim] when each head holds other tokens (float32, see rope.rotate)."""
        rows = self.key_buffer[:, :, self.start + first : self.start + first + cos.shape[-2]]
        rows.copy_(rope.rotate(rows, cos, sin))

    def memory_bytes(self) -> int:
        """Bytes the K/V buffers hold, spare capacity included (not the shared scratch)."""
        held = [t for t in (self.key_buffer, self.value_buffer) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    @property
    def kv_heads(self) -> int:
        return self.key_buffer.shape[1]

    def share_scratch(self, scratch: Scratch) -> None:
        self.scratch = scratch

    # --- internals -------------------------------------------------------------------------

    def _anchor(self, kept: list[tuple[int, int, int]], length: int) -> int:
        """Buffer row of new row 0: the longest run that can stay in place, else row 0."""
        for old, new, _ in sorted(kept, key=lambda run: -run[2]):
            start = self.start + old - new
            if start >= 0 and start + length <= self.capacity:
                return start
        if self.start + length <= self.capacity:
            return self.start
        return 0

    def _move(self, src: int, dst: int, count: int) -> None:
        """Move buffer rows [src, src + count) to [dst, dst + count) in both buffers."""
        if count <= 0 or src == dst:
            return
        for buffer in (self.key_buffer, self.value_buffer):
            rows = buffer[:, :, src : src + count]
            if abs(dst - src) < count:  # overlapping: go through a temporary
                rows = self.scratch.hold(rows)
            buffer[:, :, dst : dst + count].copy_(rows)

    def _grow(self, length: int, kept: list[tuple[int, int, int]], new_length: int) -> None:
        capacity = max(length, 2 * self.capacity)
        keys, values = buffers.rows_like(self.key_buffer, capacity), buffers.rows_like(self.value_buffer, capacity)
        for old, new, count in kept:
            keys[:, :, new : new + count] = self.key_buffer[:, :, self.start + old : self.start + old + count]
            values[:, :, new : new + count] = self.value_buffer[:, :, self.start + old : self.start + old + count]
        self.key_buffer, self.value_buffer, self.capacity = keys, values, capacity
        self.start, self.length = 0, new_length

    def _check_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_rows(key_states, value_states, self.key_buffer.shape[1], self.key_buffer.shape[3], self.dtype,
                   self.device)


class Scratch:
    """One temporary buffer shared by every layer's overlapping row moves: moves run one
    layer at a time, so it never needs more than one run of one layer's rows."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def hold(self, rows: torch.Tensor) -> torch.Tensor:
        """A copy of `rows` [1, kv_heads, n, head_dim] in the scratch buffer."""
        b = self.buffer
        if b is None or b.shape[2] < rows.shape[2] or b.shape[1] != rows.shape[1] or b.shape[3] != rows.shape[3] \
                or b.dtype != rows.dtype or b.device != rows.device:
            self.buffer = b = buffers.empty((1, rows.shape[1], max(rows.shape[2], 64), rows.shape[3]),
                                            rows.dtype, rows.device)
        held = b[:, :, : rows.shape[2]]
        held.copy_(rows)
        return held

    def memory_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()
