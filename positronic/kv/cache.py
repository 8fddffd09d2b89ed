"""SpliceCache: a transformers `Cache` whose rows can be deleted, inserted and re-rotated.

A `SpliceCache` is a list of `SpliceLayer`s, one per model layer, in the shape of
transformers 5.x `cache_utils`. Each layer owns a preallocated K/V buffer and a window
`[start, start + length)` of live rows in it:

    key_buffer, value_buffer: [batch=1, kv_heads, capacity, head_dim]
    keys, values (live views): [1, kv_heads, length, head_dim]

For the model it behaves like a `DynamicCache`: `update()` appends the new rows after the
live ones (written with `index_copy_`) and returns the live views, so a user's own
`model.generate(ids, **with_cache(SpliceCache(model.config, max_cache_len=N)))` works (`with_cache`:
`cache=` or `past_key_values=`, whichever the installed transformers takes).

For the brain it also offers row edits, all in place:
- `splice(kept, length)`: the new row layout after a tick's deletions and insertions, given
  as the runs of surviving rows (old row → new row). The longest run stays where it is and
  the others move, so an edit near either end moves only the rows on that side.
- `fill(rows)`: the next forward writes its K/V into these (already live) rows instead of
  appending — how inserted tokens land in the gaps a splice opened.
- `rotate_keys(first, cos, sin)`: re-rotate the keys of rows first.. to new RoPE positions.
- `memory_bytes()`, `reset()`, `crop()`.

`SpliceCache(..., store="ring", sinks=k)` keeps rows in a ring instead (`RingLayer`): the
streaming policy's evictions then only move a cursor, and nothing is ever packed down.

`SpliceCache(..., kv_format="int4" | "fp4")` stores rows in 4 bits instead
(`PackedSpliceLayer`, codecs in kv_formats.py): the same edits move codes and scales
together, and the model reads rows decoded. `kv_format="int4h"` (`Int4HLayer`) stores keys
before RoPE, so it reads each row at its position (`set_positions`, `RowPositions`).
`kv_format="float"` (the default) is the SpliceLayer above, unchanged.

Only `StateManager` edits a SpliceCache inside the brain; the model only appends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from positronic.mirror import Ring

from . import buffers, formats as kv_formats, triton_kernel as kv_triton, rope

DEFAULT_CAPACITY = 256
STORES = ("splice", "ring")


def check_store(store: str) -> str:
    """ValueError unless `store` names a cache store."""
    if store not in STORES:
        raise ValueError(f"unknown kv store {store!r}; choose from {', '.join(STORES)}")
    return store


class OneSequenceLayer(CacheLayerMixin):
    """What every layer of this project's caches shares: one sequence (batch 1, no beam
    search), `length` live rows, growth without a fixed maximum, `crop` from the end."""

    cache_name = "SpliceCache"  # named in the refusals
    length: int

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
        self.scratch = _Scratch()  # SpliceCache gives all its layers one shared scratch

    # --- what the model sees ---------------------------------------------------------------

    @property
    def keys(self) -> torch.Tensor | None:
        """Live keys [1, kv_heads, length, head_dim] (a view of the buffer)."""
        return None if self.key_buffer is None else self.key_buffer[:, :, self.start : self.start + self.length]

    @property
    def values(self) -> torch.Tensor | None:
        """Live values [1, kv_heads, length, head_dim] (a view of the buffer)."""
        return None if self.value_buffer is None else self.value_buffer[:, :, self.start : self.start + self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty K/V buffers of `capacity` rows shaped like the first rows (RingLayer shares it)."""
        if key_states.shape[0] != 1:
            raise ValueError(f"SpliceCache holds one sequence; got a batch of {key_states.shape[0]}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buffer = SpliceLayer._empty(key_states, self.capacity)
        self.value_buffer = SpliceLayer._empty(value_states, self.capacity)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new rows [1, kv_heads, n, head_dim]: into the rows `fill()` named, or after
        the live rows. Returns the live keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_rows(key_states, value_states)
        count = key_states.shape[-2]
        if self._write_rows is not None:
            if len(self._write_rows) != count:
                raise ValueError(f"the forward brought {count} rows for {len(self._write_rows)} open slots")
            where = self._write_rows + self.start
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

    def splice_heads(self, kept: list[list[tuple[int, int, int]]], length: int) -> None:
        """Each kv head keeps its own rows (a per-head policy): head h's runs are kept[h], as in
        `splice`; every head then holds `length` rows. The heads share one anchor (`start`):
        the buffer row of new row 0 that leaves the fewest rows to move over all heads (a
        dropped memory row lies in the older part, so usually the rows before it move up one)."""
        if len(kept) != self.key_buffer.shape[1]:
            raise ValueError(f"{len(kept)} run lists for {self.key_buffer.shape[1]} kv heads")
        if max(length, self.length) > self.capacity:  # more room first, every row where it is
            self._grow(max(length, self.length), [(0, 0, self.length)], self.length)
        runs = [(head, old, new, count) for head, head_runs in enumerate(kept) for old, new, count in head_runs
                if count > 0]
        candidates = {self.start} | {self.start + old - new for _, old, new, _ in runs}
        fitting = [a for a in candidates if a >= 0 and a + length <= self.capacity] or [0]

        def moved(anchor: int) -> int:
            return sum(count for _, old, new, count in runs if self.start + old != anchor + new)

        anchor = min(fitting, key=lambda a: (moved(a), a != self.start))
        moves = [(head, self.start + old, anchor + new, count) for head, old, new, count in runs
                 if self.start + old != anchor + new]
        if moves:
            # every moving row held at once (one copy for all heads), then each run written from
            # the copy: no order to keep, whichever way the runs go
            low, high = min(m[1] for m in moves), max(m[1] + m[3] for m in moves)
            for buffer in (self.key_buffer, self.value_buffer):
                held = self.scratch.hold(buffer[:, :, low:high])
                for head, src, dst, count in moves:
                    buffer[:, head, dst : dst + count].copy_(held[:, head, src - low : src - low + count])
        self.start, self.length = anchor, length

    def rotate_keys(self, first: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Re-rotate the keys of live rows first .. first + rows by cos/sin [rows, head_dim], or
        [kv_heads, rows, head_dim] when each head holds other tokens (float32, see rope.rotate)."""
        rows = self.key_buffer[:, :, self.start + first : self.start + first + cos.shape[-2]]
        rows.copy_(rope.rotate(rows, cos, sin))

    def memory_bytes(self) -> int:
        """Bytes the K/V buffers hold, spare capacity included (not the shared scratch)."""
        held = [t for t in (self.key_buffer, self.value_buffer) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

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
        keys, values = self._empty(self.key_buffer, capacity), self._empty(self.value_buffer, capacity)
        for old, new, count in kept:
            keys[:, :, new : new + count] = self.key_buffer[:, :, self.start + old : self.start + old + count]
            values[:, :, new : new + count] = self.value_buffer[:, :, self.start + old : self.start + old + count]
        self.key_buffer, self.value_buffer, self.capacity = keys, values, capacity
        self.start, self.length = 0, new_length

    @staticmethod
    def _empty(like: torch.Tensor, capacity: int) -> torch.Tensor:
        return buffers.empty((1, like.shape[1], capacity, like.shape[-1]), like.dtype, like.device)

    def _check_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        want = (1, self.key_buffer.shape[1], self.key_buffer.shape[3])
        for name, rows in (("keys", key_states), ("values", value_states)):
            if rows.dim() != 4 or (rows.shape[0], rows.shape[1], rows.shape[3]) != want:
                raise ValueError(f"new {name} have shape {list(rows.shape)}; this cache takes "
                                 f"[1, {want[1]}, n, {want[2]}]")
            if rows.dtype != self.dtype or rows.device != self.device:
                raise ValueError(f"new {name} are {rows.dtype} on {rows.device}; the cache holds "
                                 f"{self.dtype} on {self.device}")
        if key_states.shape[2] != value_states.shape[2]:
            raise ValueError(f"{key_states.shape[2]} new key rows but {value_states.shape[2]} value rows")


class _Scratch:
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


class PackedSpliceLayer(OneSequenceLayer):
    """One layer's K/V rows in a 4-bit format: codes and one float16 scale per (kv head, row).

    SpliceLayers hold the parts of the rows (here codes and scales; Int4HLayer adds zero
    points), taking every row edit with the same arguments, so their windows are identical
    and row i of one is row i of the others: everything SpliceLayer does to rows (the longest
    run stays put, packing down, growth, the shared scratch) applies unchanged to each part.

        codes:  int32   [1, kv_heads, capacity, head_dim // 8]   (two buffers: keys, values)
        scales: float16 [1, kv_heads, capacity, 1]

    New rows are encoded as they are written; reads (`keys`, `values`, what `update` returns
    to the model's attention) decode the live rows into the model's dtype, fresh each time:
    no float copy is kept, which is the point. So the model attends over decoded rows, the
    newest one included, and a fresh computation quantized the same way gives the same rows.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, codec, capacity: int = DEFAULT_CAPACITY):
        self.codec = codec
        self.codes = SpliceLayer(capacity)
        self.scales = SpliceLayer(capacity)
        self.dtype: torch.dtype | None = None  # what the model writes and reads back
        self.device: torch.device | None = None
        self.kv_heads = self.head_dim = 0

    @property
    def parts(self) -> list[SpliceLayer]:
        """The SpliceLayers that together hold the rows (each edit goes to all of them)."""
        return [self.codes, self.scales]

    # --- what the model sees ---------------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        return self.codes.is_initialized

    @property
    def length(self) -> int:
        return self.codes.length

    @property
    def start(self) -> int:
        return self.codes.start

    @property
    def capacity(self) -> int:
        return self.codes.capacity

    @property
    def keys(self) -> torch.Tensor | None:
        """Live keys decoded: [1, kv_heads, length, head_dim] in the model's dtype (a new tensor)."""
        return None if not self.is_initialized else self._decode("keys")

    @property
    def values(self) -> torch.Tensor | None:
        """Live values decoded: [1, kv_heads, length, head_dim] in the model's dtype (a new tensor)."""
        return None if not self.is_initialized else self._decode("values")

    def _decode(self, side: str) -> torch.Tensor:
        """The live rows of one side ("keys" or "values") decoded."""
        return self.codec.decode(getattr(self.codes, side), getattr(self.scales, side)[..., 0], self.dtype)

    def _decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Live keys and values decoded together (what a forward reads), each [1, kv_heads, length, head_dim]."""
        if kv_triton.usable(self.codes.keys, self.head_dim):  # one fused kernel on a GPU
            return kv_triton.decode_pair(self.codes.keys, self.scales.keys[..., 0], self.codes.values,
                                         self.scales.values[..., 0], self.codec.levels, self.dtype)
        codes = torch.stack([self.codes.keys, self.codes.values])  # [2, 1, kv_heads, length, head_dim // 8]
        scales = torch.stack([self.scales.keys, self.scales.values])[..., 0]
        both = self.codec.decode(codes, scales, self.dtype)
        return both[0], both[1]

    def _encode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """New rows -> (keys, values) of each part, in the order of `parts`."""
        # keys and values in one encode: on a CPU these small ops cost more in per-call
        # overhead than in arithmetic
        codes, scales = self.codec.encode(torch.stack([key_states, value_states]))
        return [(codes[0], codes[1]), (scales[0].unsqueeze(-1), scales[1].unsqueeze(-1))]

    @property
    def _write_rows(self) -> torch.Tensor | None:  # set by SpliceCache.fill, as on a SpliceLayer
        return self.codes._write_rows

    @_write_rows.setter
    def _write_rows(self, rows: torch.Tensor | None) -> None:
        for part in self.parts:
            part._write_rows = rows

    def share_scratch(self, *scratches: "_Scratch") -> None:
        """One scratch per part for every layer (each scratch keeps one dtype), in the order of `parts`."""
        for part, scratch in zip(self.parts, scratches, strict=True):
            part.scratch = scratch

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError(f"SpliceCache holds one sequence; got a batch of {key_states.shape[0]}")
        if key_states.shape[-1] % kv_formats.CODES_PER_WORD:
            raise ValueError(f"the {self.codec.name} format packs {kv_formats.CODES_PER_WORD} values per int32: "
                             f"head_dim {key_states.shape[-1]} is not a multiple of {kv_formats.CODES_PER_WORD}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.kv_heads, self.head_dim = key_states.shape[1], key_states.shape[-1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Encode new rows [1, kv_heads, n, head_dim] and store them where a SpliceLayer would
        (the rows `fill()` named, or after the live rows). Returns the live keys and values,
        decoded."""
        if self.dtype is None:
            self.lazy_initialization(key_states, value_states)
        self._check_rows(key_states, value_states)
        self.write_encoded(self._encode(key_states, value_states))
        return self._decoded()

    def write_encoded(self, encoded: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store rows already encoded: (keys, values) of each part, in the order of `parts`,
        where `update` would (a resumed session's int4h rows)."""
        for part, (keys, values) in zip(self.parts, encoded, strict=True):  # the first checks the fill count
            part.update(keys, values)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def reset(self) -> None:
        """Drop every row; the buffers are kept for reuse."""
        for part in self.parts:
            part.reset()

    def crop(self, tokens_to_remove: int) -> None:
        for part in self.parts:
            part.crop(tokens_to_remove)

    # --- row edits -------------------------------------------------------------------------

    def splice(self, kept: list[tuple[int, int, int]], length: int) -> None:
        """As SpliceLayer.splice: moving a row moves each of its parts."""
        for part in self.parts:
            part.splice(kept, length)

    def rotate_keys(self, first: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Re-rotate the keys of live rows first .. first + len(cos): decode, rotate in float32
        (rope.rotate), encode again. The new codes carry a fresh rounding error on top of the
        old one (docs/kv_formats.md bounds it)."""
        rows = slice(first, first + len(cos))
        codes, scales = self.codes.keys[:, :, rows], self.scales.keys[:, :, rows]
        rotated = rope.rotate(self.codec.decode(codes, scales[..., 0]), cos, sin)
        new_codes, new_scales = self.codec.encode(rotated)
        codes.copy_(new_codes)  # views of the buffers: written in place
        scales.copy_(new_scales.unsqueeze(-1))

    def memory_bytes(self) -> int:
        """Bytes the parts' buffers hold, spare capacity included (not the scratch)."""
        return sum(part.memory_bytes() for part in self.parts)

    def _check_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        want = (1, self.kv_heads, self.head_dim)
        for name, rows in (("keys", key_states), ("values", value_states)):
            if rows.dim() != 4 or (rows.shape[0], rows.shape[1], rows.shape[3]) != want:
                raise ValueError(f"new {name} have shape {list(rows.shape)}; this cache takes "
                                 f"[1, {want[1]}, n, {want[2]}]")
            if rows.dtype != self.dtype or rows.device != self.device:
                raise ValueError(f"new {name} are {rows.dtype} on {rows.device}; the cache holds "
                                 f"{self.dtype} on {self.device}")
        if key_states.shape[2] != value_states.shape[2]:
            raise ValueError(f"{key_states.shape[2]} new key rows but {value_states.shape[2]} value rows")


class RowPositions:
    """The RoPE position of every row of a cache whose layers store keys before RoPE (int4h),
    shared by its layers; the cos/sin of the live rows are computed once per layout and
    reused by every layer.

    Whoever lays rows out sets them (`SpliceCache.set_positions`: StateManager after each edit,
    for the rows a forward is about to write too, before a rebuild and on a resume). A cache
    nobody set them on and that was never spliced is append-only (a user's own `generate`):
    row i is at position i. A splice forgets them: reading or writing rows before they are set
    again is refused.
    """

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.tensor: torch.Tensor | None = None  # int64 [rows], on the cache's device
        self.stale = False
        self._rotation: tuple | None = None  # (count, device, cos, sin) of the last `rotation`; cleared on set

    def set(self, positions: torch.Tensor) -> None:
        self.tensor, self.stale, self._rotation = positions.to(torch.long), False, None

    def moved(self) -> None:
        """The rows moved (a splice): their positions must be set again before use."""
        self.tensor, self.stale, self._rotation = None, True, None

    def reset(self) -> None:
        self.tensor, self.stale, self._rotation = None, False, None

    def of(self, rows: torch.Tensor) -> torch.Tensor:
        """Positions int64 [n] of rows [n] (int64, on the cache's device)."""
        if self.tensor is None:
            if self.stale:
                raise ValueError("int4h rows were moved: the cache needs their positions (set_positions) "
                                 "before it can read or write them")
            return rows
        if len(rows) and int(rows.max()) >= len(self.tensor):
            raise ValueError(f"row {int(rows.max())} has no position: {len(self.tensor)} were set")
        return self.tensor.to(rows.device)[rows]

    def rotation(self, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [count, head_dim] float32 that rotate rows 0..count-1 from position 0 to
        theirs (cos, -sin rotate them back: the angles are negated exactly). Computed once per
        layout and count: every layer's reads and writes of a forward share it."""
        if self._rotation is None or self._rotation[:2] != (count, device):
            positions = self.of(torch.arange(count, device=device)).cpu()
            cos, sin = rope.rotation(self.inv_freq, torch.zeros_like(positions), positions)
            self._rotation = (count, device, cos.to(device), sin.to(device))
        return self._rotation[2], self._rotation[3]


class Int4HLayer(PackedSpliceLayer):
    """One layer's rows in the int4h format (kv_formats.Int4H): keys un-rotated to position 0
    and centred, K and V Hadamard-rotated, then 4-bit codes with a float16 scale and a zero
    point per group of 32 values.

        codes:  int32   [1, kv_heads, capacity, head_dim // 8]   (keys, values)
        scales: float16 [1, kv_heads, capacity, groups]
        zeros:  uint8   [1, kv_heads, capacity, groups]

    A stored key does not depend on its position: reading rotates it to the position the
    cache's RowPositions give, so re-rotation (`rotate_keys`) is exact — there is nothing to
    do, the new position is read next time. `key_centre` [kv_heads, head_dim] is this layer's
    mean pre-RoPE key (positronic/kv/centres.py; None: zeros, which work less well)."""

    def __init__(self, codec: kv_formats.Int4H, capacity: int, positions: RowPositions,
                 key_centre: torch.Tensor | None):
        super().__init__(codec, capacity)
        self.zeros = SpliceLayer(capacity)
        self.positions = positions
        self.key_centre = key_centre
        # set at the first write, on the rows' device: H [head_dim, head_dim], the centre [1, kv_heads, 1, head_dim]
        self.hadamard: torch.Tensor | None = None
        self.centre: torch.Tensor | None = None

    @property
    def parts(self) -> list[SpliceLayer]:
        return [self.codes, self.scales, self.zeros]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.hadamard = kv_formats.hadamard(self.head_dim).to(self.device)
        centre = torch.zeros(self.kv_heads, self.head_dim) if self.key_centre is None else self.key_centre
        if tuple(centre.shape) != (self.kv_heads, self.head_dim):
            raise ValueError(f"the int4h key centre is {tuple(centre.shape)}; this layer's keys are "
                             f"({self.kv_heads}, {self.head_dim}) per row")
        self.centre = centre.to(self.device, torch.float32)[None, :, None, :]

    def _decode(self, side: str) -> torch.Tensor:
        coded = self.codec.decode(getattr(self.codes, side), getattr(self.scales, side), getattr(self.zeros, side))
        rows = coded @ self.hadamard  # H^T = H
        if side == "keys":
            cos, sin = self.positions.rotation(self.length, self.device)
            rows = rope.rotate(rows + self.centre, cos, sin)
        return rows.to(self.dtype)

    def _decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode("keys"), self._decode("values")

    def _encode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        count = key_states.shape[2]
        if self._write_rows is not None:  # into gaps of the live rows
            rows, length = self._write_rows.to(self.device), self.length
        else:  # appended: the live rows after this write are the ones the read will rotate
            rows, length = torch.arange(self.length, self.length + count, device=self.device), self.length + count
        cos, sin = self.positions.rotation(length, self.device)  # the same for every layer of the forward
        plain = rope.rotate(key_states.float(), cos[rows], -sin[rows]) - self.centre  # back to position 0
        codes, scales, zeros = self.codec.encode(torch.stack([plain, value_states.float()]) @ self.hadamard)
        return [(codes[0], codes[1]), (scales[0], scales[1]), (zeros[0], zeros[1])]

    def coded_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What this layer would make of keys [1, kv_heads, n, head_dim] at `positions` [n]
        before quantizing them (c = H (R(-p) k - m)): for error bounds (Int4H.error_bound)."""
        cos, sin = rope.rotation(self.positions.inv_freq, positions.cpu(), torch.zeros_like(positions.cpu()))
        return (rope.rotate(keys.float(), cos, sin) - self.centre) @ self.hadamard

    def coded_values(self, values: torch.Tensor) -> torch.Tensor:
        """c = H v for values [1, kv_heads, n, head_dim]."""
        return values.float() @ self.hadamard

    def rotate_keys(self, first: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Nothing to do: keys are stored before RoPE, and a read rotates them to the
        positions set after the move (exact)."""


@dataclass(frozen=True)
class RingPlan:
    """A splice of a ring store, worked out once for every layer: the ring after it, the live
    length, whether the buffers grow, and the (from slots, to slots) of the rows that move
    (int64 [n] each; None: no row moves)."""

    ring: Ring
    length: int
    grow: bool
    moves: tuple[torch.Tensor, torch.Tensor] | None


class RingLayer(OneSequenceLayer):
    """One layer's K/V rows in a ring (`SpliceCache(..., store="ring")`), for sliding windows.

    The sink rows keep slots 0..sinks-1; the window rows wrap round the other slots from the
    cursor (mirror/ring.py, `Ring`, maps live rows to slots). So the streaming policy's
    eviction of the oldest window rows moves only the cursor, and a new row is written with
    `index_copy_` into the slot after the newest: no row is copied, however long the run,
    where a SpliceLayer packs its rows down whenever its window reaches the buffer's end.
    Any other edit still works: kept rows whose slot changes go through one gather and one
    `index_copy_` (the cursor follows the longest kept run, so few move).

        key_buffer, value_buffer: [1, kv_heads, capacity, head_dim], slots in ring order
        keys, values:             [1, kv_heads, length, head_dim], live rows in row order
                                  (a view while row i is slot i, else gathered: for readers)

    `update` returns the slots 0..used-1 (`Ring.used`) in slot order, without a copy. The
    newest token's attention does not depend on the order of the rows it attends, but free
    slots among them must be hidden: `forward` builds that mask from `slot_rows`. A ring
    that never evicted is linear (row i in slot i), so transformers' own masks fit it too.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, capacity: int = DEFAULT_CAPACITY, sinks: int = 0):
        self.ring = Ring(sinks, capacity, sinks)
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self.length = 0
        self.is_initialized = False
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self._write_rows: torch.Tensor | None = None  # live rows the next update() fills
        self._write_slots: torch.Tensor | None = None  # their slots (SpliceCache.fill maps them once for all layers)
        self.moved_rows = 0  # rows copied by splices and growth since creation (0 while streaming)
        self.seen = 0  # slots 0..seen-1 hold a written row or zeros: what a forward may read (see _clear_free)

    @property
    def capacity(self) -> int:
        return self.ring.capacity

    # --- what the model and the readers see --------------------------------------------------

    @property
    def keys(self) -> torch.Tensor | None:
        """Live keys [1, kv_heads, length, head_dim] in row order."""
        return None if self.key_buffer is None else self._rows(self.key_buffer)

    @property
    def values(self) -> torch.Tensor | None:
        """Live values [1, kv_heads, length, head_dim] in row order."""
        return None if self.value_buffer is None else self._rows(self.value_buffer)

    def _rows(self, buffer: torch.Tensor) -> torch.Tensor:
        if self.ring.linear(self.length):
            return buffer[:, :, : self.length]
        return buffer.index_select(2, self.slot_index(self.length))

    def slot_index(self, length: int) -> torch.Tensor:
        """int64 [length]: the slot of each of rows 0..length-1."""
        return self.slots_of(torch.arange(length, device=self.device))

    def slots_of(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 like `rows`: the slot of each live row (Ring.slot, as tensor arithmetic: a tick
        would spend more on a Python list of every row than on the attention itself)."""
        ring = self.ring
        window = ring.sinks + (rows + (ring.cursor - 2 * ring.sinks)).remainder(ring.window)
        return torch.where(rows < ring.sinks, rows, window)

    def slot_rows(self, length: int) -> torch.Tensor:
        """int64 [Ring.used(length)]: the row each used slot holds, -1 for a free slot."""
        rows = torch.full((self.ring.used(length),), -1, dtype=torch.long, device=self.device)
        return rows.index_copy_(0, self.slot_index(length), torch.arange(length, device=self.device))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        SpliceLayer.lazy_initialization(self, key_states, value_states)
        self.seen = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new rows [1, kv_heads, n, head_dim] in their slots: the rows `fill()` named, or
        after the live rows. Returns the used slots' keys and values, in slot order (the free
        ones among them hold written rows or zeros, never garbage: `_clear_free`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        SpliceLayer._check_rows(self, key_states, value_states)
        count = key_states.shape[-2]
        if self._write_rows is not None:
            if len(self._write_rows) != count:
                raise ValueError(f"the forward brought {count} rows for {len(self._write_rows)} open slots")
            where = self._write_slots if self._write_slots is not None \
                else self.slot_index(self.length).index_select(0, self._write_rows)
        else:
            self.reserve(self.length + count)
            self.length += count
            where = self.slots_of(torch.arange(self.length - count, self.length, device=self.device))
        self.key_buffer.index_copy_(2, where, key_states)
        self.value_buffer.index_copy_(2, where, value_states)
        used = self.ring.used(self.length)
        if used > self.seen:
            self._clear_free(used)
        return self.key_buffer[:, :, :used], self.value_buffer[:, :, :used]

    def _clear_free(self, used: int) -> None:
        """Zero the free slots among 0..used-1 that were never written, once.

        The model attends over every used slot and the mask hides the free ones (`forward`,
        `slot_rows`), but a mask does not make garbage harmless: a masked score is the key's
        product plus the mask, and a masked weight of 0 still multiplies the value, so one NaN
        or inf in a free slot (which a new buffer may hold) makes the whole output NaN. A free
        slot that held a row before (an evicted one) is finite already; one that never did (a
        resumed or rebuilt ring laid out from a cursor past the sinks, a cursor moved back over
        slots never reached) is zeroed here, before the first read that includes it. Live slots
        are always written before they are read (appended, filled, or moved), so only the free
        run needs this, and only while `used` passes the slots seen so far: a streaming tick
        does no tensor op for it."""
        free = self.ring.free(self.length)
        first, end = max(free.start, self.seen), min(free.stop, used)
        if first < end:
            self.key_buffer[:, :, first:end].zero_()
            self.value_buffer[:, :, first:end].zero_()
        self.seen = used

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        appended = 0 if self._write_rows is not None else query_length
        return self.ring.used(self.length + appended), 0

    def reset(self) -> None:
        """Drop every row; the buffers and the cursor are kept (a rebuild refills the same slots)."""
        self.length = 0
        self._write_rows = None

    def set_ring(self, ring: Ring) -> None:
        """Lay the rows out as `ring` says from now on (a resumed or rebuilt state takes the
        mirror's cursor); the layer must be empty."""
        if self.length:
            raise ValueError("set_ring needs an empty cache layer")
        if ring.capacity != self.capacity and self.is_initialized:
            self.key_buffer = SpliceLayer._empty(self.key_buffer, ring.capacity)
            self.value_buffer = SpliceLayer._empty(self.value_buffer, ring.capacity)
            self.seen = 0
        self.ring = ring

    # --- row edits -------------------------------------------------------------------------

    def reserve(self, length: int) -> None:
        """Room for `length` rows: a larger ring (Ring.after) when they do not fit."""
        if length > self.capacity:
            live = self.length
            self.splice([(0, 0, live)], length)
            self.length = live

    def splice(self, kept: list[tuple[int, int, int]], length: int) -> None:
        """Rearrange the live rows (runs (old_row, new_row, count), as SpliceLayer.splice): the
        cursor follows the longest kept window run, and only rows whose slot changes are copied
        (a streaming eviction: none)."""
        self.apply(self.plan(kept, length))

    def plan(self, kept: list[tuple[int, int, int]], length: int) -> RingPlan:
        """What a splice does to this ring (the same for every layer: they share the cursor)."""
        new = self.ring.after(kept, length)
        grow = new.capacity != self.capacity
        source, target = self.ring.moves(kept, new, every=grow)
        moves = None
        if source:
            moves = (torch.tensor(source, dtype=torch.long, device=self.device),
                     torch.tensor(target, dtype=torch.long, device=self.device))
        return RingPlan(new, length, grow, moves)

    def apply(self, plan: RingPlan) -> None:
        if plan.moves is not None and self.is_initialized:
            source, target = plan.moves
            buffers = []
            for buffer in (self.key_buffer, self.value_buffer):
                rows = buffer.index_select(2, source)  # gathered first: moves may overlap
                into = SpliceLayer._empty(buffer, plan.ring.capacity) if plan.grow else buffer
                buffers.append(into.index_copy_(2, target, rows))
            self.key_buffer, self.value_buffer = buffers
            self.moved_rows += len(source)
        elif plan.grow and self.is_initialized:
            self.key_buffer = SpliceLayer._empty(self.key_buffer, plan.ring.capacity)
            self.value_buffer = SpliceLayer._empty(self.value_buffer, plan.ring.capacity)
        if plan.grow:
            self.seen = 0  # a new buffer: the kept rows were copied in, the rest is unwritten
        self.ring, self.length = plan.ring, plan.length

    def rotate_keys(self, first: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Re-rotate the keys of live rows first .. first + len(cos) (rope.rotate), wherever
        their slots are."""
        where = self.slot_index(self.length)[first : first + len(cos)]
        rows = self.key_buffer.index_select(2, where)
        self.key_buffer.index_copy_(2, where, rope.rotate(rows, cos, sin))

    def memory_bytes(self) -> int:
        """Bytes the K/V buffers hold, free slots included."""
        held = [t for t in (self.key_buffer, self.value_buffer) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)



class SpliceCache(Cache):
    """A transformers Cache of `SpliceLayer`s: what the model reads and writes, and what
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
        codec = kv_formats.packed(kv_format)
        self.kv_format, self.store = kv_format, check_store(store)
        self.positions: RowPositions | None = None
        if store == "ring":
            if codec is not None:
                raise ValueError(f"the ring store keeps float rows: kv_format {kv_format} needs the splice store")
            super().__init__(layers=[RingLayer(max_cache_len, sinks) for _ in range(num_layers)])
        elif codec is None:
            super().__init__(layers=[SpliceLayer(max_cache_len) for _ in range(num_layers)])
        elif kv_format == "int4h":
            if config is None:
                raise ValueError("the int4h format needs the model config (its RoPE frequencies)")
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            if head_dim & (head_dim - 1):
                raise ValueError(f"the int4h format rotates rows by a Hadamard matrix: head_dim must be a power of "
                                 f"two, this model's is {head_dim} (use int4 or fp4)")
            if key_centres is not None and len(key_centres) != num_layers:
                raise ValueError(f"{len(key_centres)} key centres for {num_layers} layers")
            self.positions = RowPositions(rope.inv_freq_for_config(config))
            super().__init__(layers=[Int4HLayer(codec, max_cache_len, self.positions,
                                                None if key_centres is None else key_centres[i])
                                     for i in range(num_layers)])
        else:
            super().__init__(layers=[PackedSpliceLayer(codec, max_cache_len) for _ in range(num_layers)])
        self.scratch = _Scratch()
        # each part of a packed row moves through a scratch of its own dtype (codes share the float one's slot)
        self.part_scratches = [self.scratch] + [_Scratch() for _ in self.layers[0].parts[1:]] \
            if isinstance(self.layers[0], PackedSpliceLayer) else [self.scratch]
        for layer in self.layers:
            if isinstance(layer, SpliceLayer):
                layer.scratch = self.scratch
            elif isinstance(layer, PackedSpliceLayer):
                layer.share_scratch(*self.part_scratches)

    @property
    def rotation_rounds(self) -> bool:
        """Whether re-rotating a key rounds it again (int4, fp4: decoded, rotated, encoded);
        float keys rotate in float32, int4h keys only change position."""
        return self.kv_format in kv_formats.ROW_SCALED

    def set_positions(self, positions, *more) -> None:
        """int4h: the RoPE positions of rows 0..n-1 (ints, n >= the live rows; `more` lists
        follow them: rows a forward is about to write after the live ones), read by every layer
        to rotate its keys. Other formats keep keys rotated and need none: a no-op (nothing is
        built)."""
        if self.positions is not None:
            device = self.layers[0].device or "cpu"
            every = list(positions) + [p for extra in more for p in extra]
            self.positions.set(torch.tensor(every, dtype=torch.long, device=device))

    @property
    def ring(self) -> Ring | None:
        """The ring store's slot mapping (the same in every layer), or None."""
        return self.layers[0].ring if self.store == "ring" else None

    def set_ring(self, ring: Ring) -> None:
        """Ring store, empty: lay rows out as `ring` says (the mirror's cursor, on a resume or
        a rebuild)."""
        if self.store != "ring":
            raise ValueError(f"the {self.store} store has no ring")
        for layer in self.layers:
            layer.set_ring(ring)

    def reserve(self, length: int) -> None:
        """Ring store: room for `length` rows before a forward that appends them. A ring
        cannot grow half-way through a forward: its mask was laid out by slot before it. (The
        splice store makes room as it goes.)"""
        if self.store == "ring":
            for layer in self.layers:
                layer.reserve(length)

    def slot_rows(self, length: int) -> torch.Tensor | None:
        """Ring store: the row held by each of the slots that `length` rows use (-1: free), what
        the model's attention sees in that order; None for the splice store (slot = row)."""
        return self.layers[0].slot_rows(length) if self.store == "ring" else None

    def slot_index(self, length: int) -> torch.Tensor | None:
        """Ring store: the slot of each of rows 0..length-1; None for the splice store."""
        return self.layers[0].slot_index(length) if self.store == "ring" else None

    @property
    def length(self) -> int:
        """Live rows (the same in every layer)."""
        return self.layers[0].length

    def splice(self, kept: list[tuple[int, int, int]], length: int) -> None:
        """Every layer: runs (old_row, new_row, count) of surviving rows move to their new rows;
        the cache then holds `length` rows, the uncovered ones being gaps for `fill`."""
        if not self.layers[0].is_initialized:
            raise ValueError("the cache is empty: nothing to splice")
        if self.store == "ring":
            plan = self.layers[0].plan(kept, length)
            for layer in self.layers:
                layer.apply(plan)
            return
        for layer in self.layers:
            layer.splice(kept, length)
        if self.positions is not None:
            self.positions.moved()

    def splice_layers(self, kept: list[list[tuple[int, int, int]]], length: int) -> None:
        """Layers that keep different rows (a per-layer policy): lane l's runs are kept[l],
        a lane being a layer, or one kv head of a layer (lane = layer * kv_heads + head) when
        heads keep different rows too; every lane then holds `length` rows."""
        if self.store == "ring":
            raise ValueError("the ring store keeps the same rows in every layer (one cursor): no per-layer splices")
        if not self.layers[0].is_initialized:
            raise ValueError("the cache is empty: nothing to splice")
        heads = self.layers[0].key_buffer.shape[1]
        if len(kept) not in (len(self.layers), len(self.layers) * heads):
            raise ValueError(f"{len(kept)} run lists for {len(self.layers)} layers of {heads} kv heads")
        if len(kept) == len(self.layers):
            for layer, runs in zip(self.layers, kept):
                layer.splice(runs, length)
            return
        for index, layer in enumerate(self.layers):
            layer.splice_heads(kept[index * heads : (index + 1) * heads], length)

    @contextlib.contextmanager
    def fill(self, rows: torch.Tensor):
        """Within this block, a forward writes its new K/V into live `rows` (int64 [n],
        ascending) of every layer instead of appending."""
        # a ring maps the rows to slots once here, not in each layer's update: every layer
        # shares the cursor, and a tick's few small tensor ops per layer add up on a CPU
        slots = self.layers[0].slots_of(rows.to(self.layers[0].device)) if self.store == "ring" else None
        for layer in self.layers:
            layer._write_rows = rows
            if slots is not None:
                layer._write_slots = slots
        try:
            yield self
        finally:
            for layer in self.layers:
                layer._write_rows = None
                if slots is not None:
                    layer._write_slots = None

    def rotate_keys(self, first: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Every layer: re-rotate the keys of rows first .. first + len(cos)."""
        for layer in self.layers:
            layer.rotate_keys(first, cos, sin)

    def reset(self) -> None:
        super().reset()
        if self.positions is not None:
            self.positions.reset()

    def memory_bytes(self) -> int:
        """K/V buffers of every layer (4-bit: codes, scales, zero points), the shared scratch
        buffers, and int4h's row positions."""
        scratch = sum(s.memory_bytes() for s in self.part_scratches)
        positions = self.positions.tensor if self.positions is not None and self.positions.tensor is not None else None
        held = 0 if positions is None else positions.numel() * positions.element_size()
        return sum(layer.memory_bytes() for layer in self.layers) + scratch + held

    def memory_usage_mb(self) -> float:
        return self.memory_bytes() / 2**20
