"""RingLayer: one layer's K/V rows in a ring of slots (`SpliceCache(..., store="ring")`).

The streaming policy's evictions only move a cursor (mirror/ring.py maps rows to slots), and
nothing is ever packed down. Every layer of the cache shares the cursor: a splice is planned
once (`RingPlan`) and applied to each layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from positronic.mirror import Ring

from . import buffers, rope
from .splice import DEFAULT_CAPACITY, OneSequenceLayer, check_rows


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

    # --- what the cache does to all its layers at once: they share one cursor ---------------

    @classmethod
    def splice_all(cls, layers: list, kept: list[tuple[int, int, int]], length: int) -> None:
        plan = layers[0].plan(kept, length)  # worked out once: the same for every layer
        for layer in layers:
            layer.apply(plan)

    @classmethod
    def splice_lanes(cls, layers: list, kept: list[list[tuple[int, int, int]]], length: int) -> None:
        raise ValueError("the ring store keeps the same rows in every layer (one cursor): no per-layer splices")

    @classmethod
    def open_rows(cls, layers: list, rows: torch.Tensor) -> None:
        # the rows are mapped to slots once here, not in each layer's update: every layer
        # shares the cursor, and a tick's few small tensor ops per layer add up on a CPU
        slots = layers[0].slots_of(rows.to(layers[0].device))
        for layer in layers:
            layer._write_rows, layer._write_slots = rows, slots

    @classmethod
    def close_rows(cls, layers: list) -> None:
        for layer in layers:
            layer._write_rows = layer._write_slots = None

    @classmethod
    def reserve_all(cls, layers: list, length: int) -> None:
        """Room for `length` rows before a forward that appends them. A ring cannot grow
        half-way through a forward: its mask was laid out by slot before it."""
        for layer in layers:
            layer.reserve(length)

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
        """New K/V buffers of `capacity` slots, none written yet."""
        super().lazy_initialization(key_states, value_states)
        self.seen = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new rows [1, kv_heads, n, head_dim] in their slots: the rows `fill()` named, or
        after the live rows. Returns the used slots' keys and values, in slot order (the free
        ones among them hold written rows or zeros, never garbage: `_clear_free`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        check_rows(key_states, value_states, self.key_buffer.shape[1], self.key_buffer.shape[3], self.dtype,
                   self.device)
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
            self.key_buffer = buffers.rows_like(self.key_buffer, ring.capacity)
            self.value_buffer = buffers.rows_like(self.value_buffer, ring.capacity)
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
            moved = []
            for buffer in (self.key_buffer, self.value_buffer):
                rows = buffer.index_select(2, source)  # gathered first: moves may overlap
                into = buffers.rows_like(buffer, plan.ring.capacity) if plan.grow else buffer
                moved.append(into.index_copy_(2, target, rows))
            self.key_buffer, self.value_buffer = moved
            self.moved_rows += len(source)
        elif plan.grow and self.is_initialized:
            self.key_buffer = buffers.rows_like(self.key_buffer, plan.ring.capacity)
            self.value_buffer = buffers.rows_like(self.value_buffer, plan.ring.capacity)
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
