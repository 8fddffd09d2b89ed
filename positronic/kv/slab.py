"""Slab: every layer's K/V buffer as slices of one tensor, so a per-lane splice is one copy.

A per-head policy (SmartKV) drops a different row in each of the 90 lanes of a 30-layer,
3-kv-head model every tick. Spliced layer by layer and head by head, that is ~240 small
copies, each paying a torch call's overhead (4 ms a tick on a CPU, whether it moves 1 row or
130: the rows moved are few). In one slab, the moves of every lane become one `index_select`
and one `index_copy_` per buffer:

    keys, values: [layers, kv_heads, capacity, head_dim]
    layer i's key_buffer, value_buffer: keys[i : i + 1], values[i : i + 1] (views)

Layers keep their own `start`, `length` and `capacity`; a per-lane splice gives them all the
same `start`, so that `keys_of` reads every layer's live keys as one view (the attention row
a recall policy takes of all layers each tick, without stacking 30 layers' keys first). A
slab is made the first time lanes are spliced (copying each layer's buffer in once) and
again whenever a layer has left it (it grew alone and holds a buffer of its own).
"""

from __future__ import annotations

import numpy as np
import torch

from . import buffers


class Slab:
    """One K and one V tensor [layers, kv_heads, capacity, head_dim] that `layers` (SpliceLayers)
    read and write through views."""

    def __init__(self, layers: list, capacity: int):
        first = layers[0].key_buffer
        shape = (len(layers), first.shape[1], capacity, first.shape[3])
        self.keys = buffers.empty(shape, first.dtype, first.device)
        self.values = buffers.empty(shape, first.dtype, first.device)
        self.capacity = capacity
        for index, layer in enumerate(layers):
            held = layer.capacity
            self.keys[index, :, :held].copy_(layer.key_buffer[0])
            self.values[index, :, :held].copy_(layer.value_buffer[0])
            layer.key_buffer, layer.value_buffer = self.keys[index : index + 1], self.values[index : index + 1]
            layer.capacity, layer.slab = capacity, self
        self._views = [(layer.key_buffer, layer.value_buffer) for layer in layers]

    @classmethod
    def holding(cls, layers: list, length: int) -> "Slab":
        """The slab all `layers` live in with room for `length` rows each: theirs if they still
        do, else a new one (twice the capacity when a layer needs more)."""
        slab = layers[0].slab
        needed = max(length, *(layer.length for layer in layers))
        if slab is not None and slab.holds(layers) and needed <= slab.capacity:
            return slab
        capacity = max(layer.capacity for layer in layers)
        return cls(layers, capacity if needed <= capacity else max(needed, 2 * capacity))

    def holds(self, layers: list) -> bool:
        """Whether every layer still reads and writes this slab (none grew a buffer of its own)."""
        return len(layers) == len(self._views) and all(
            layer.key_buffer is keys and layer.value_buffer is values
            for layer, (keys, values) in zip(layers, self._views))

    def shared_start(self, layers: list) -> int | None:
        """The buffer row every layer's live rows start at, if they all live here and share one
        (after a per-lane splice); else None."""
        start = layers[0].start
        if not self.holds(layers) or any(layer.start != start for layer in layers):
            return None
        return start

    def move(self, lane: np.ndarray, src: np.ndarray, dst: np.ndarray, count: np.ndarray) -> None:
        """Copy rows at once: move i takes buffer rows src[i] .. src[i] + count[i] of lane[i]
        (layer * kv_heads + head) to dst[i] .. dst[i] + count[i] (int64 arrays [moves]). Every
        source is read before any destination is written, so moves may overlap either way."""
        if not len(count):
            return
        offsets = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        base = np.repeat(lane * self.capacity, count) + offsets
        device = self.keys.device
        read = torch.from_numpy(base + np.repeat(src, count)).to(device)
        write = torch.from_numpy(base + np.repeat(dst, count)).to(device)
        for slab in (self.keys, self.values):
            rows = slab.view(-1, slab.shape[-1])  # [layers * kv_heads * capacity, head_dim]
            rows.index_copy_(0, write, rows.index_select(0, read))

    def put(self, layers: list, lanes: np.ndarray, rows: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Write keys / values [n, head_dim] into live row rows[i] of lane lanes[i] (int64 arrays
        [n], lane = layer * kv_heads + head), one copy per buffer; False (nothing written) unless
        the layers all live here and start at the same buffer row."""
        start = self.shared_start(layers)
        if start is None:
            return False
        at = torch.from_numpy(lanes * self.capacity + start + rows).to(self.keys.device)
        for slab, given in ((self.keys, keys), (self.values, values)):
            slab.view(-1, slab.shape[-1]).index_copy_(0, at, given.to(slab.dtype))
        return True

    def keys_of(self, layers: list, rows: int) -> torch.Tensor | None:
        """The first `rows` live keys of every layer, [layers, kv_heads, rows, head_dim]: a view
        (no copy) when the layers all live here and start at the same buffer row, else None."""
        start = self.shared_start(layers)
        return None if start is None else self.keys[:, :, start : start + rows]

    def rows_of(self, layers: list, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values [layers, kv_heads, n, head_dim] of live rows `rows` (int [lanes, n], a
        lane a layer or one kv head of one), one gather per buffer; None unless the layers all
        live here and start at the same buffer row."""
        start = self.shared_start(layers)
        if start is None:
            return None
        count, kv_heads, n = len(layers), self.keys.shape[1], rows.shape[-1]
        rows = rows.reshape(count, -1, n)  # [layers, lanes a layer (1 or kv_heads), n]
        lanes = (np.arange(count)[:, None] * kv_heads + np.arange(kv_heads)[None, :]) * self.capacity + start
        index = lanes[:, :, None] + np.broadcast_to(rows, (count, kv_heads, n))  # [layers, kv_heads, n]
        at = torch.from_numpy(np.ascontiguousarray(index).reshape(-1)).to(self.keys.device)
        shape = (count, kv_heads, n, self.keys.shape[-1])
        return tuple(slab.view(-1, slab.shape[-1])[at].view(shape) for slab in (self.keys, self.values))
