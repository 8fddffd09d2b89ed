"""Core v4's cache: the K/V rows of many sequences in fixed buffers, one slot per sequence.

Every layer's keys and values of up to `slots` sequences live in two preallocated tensors,
`[layers, slots, kv_heads, capacity, head_dim]`. Sequence s's live rows are rows
`0..length[s]-1` of slot s, in row order (an edit closes its gaps: `compact`); its RoPE
positions are kept next to them by the state (positronic/state/slots.py), not here.

A decode round is one forward over the first `active` slots (`SlotCache`): each slot's new
row is written with one `index_put_` per layer, and attention reads the whole
`[active, kv_heads, capacity, head_dim]` view under a mask that hides rows past each slot's
length (`models.attention.decode_attention`). The width is the capacity whatever the other
slots hold, so a sequence's attention is the same computation batched as alone, bit for bit,
and the shapes never change from round to round.

Rows past a slot's length are never read with a weight, but a masked score is the key's
product plus the mask and a weight of 0 still multiplies the value: a NaN there would poison
the row's softmax. So the buffers start zeroed, once (even in the NaN-fill test mode, whose
point is rows read that were never written: a live row here is always written first), and
later hold only rows that were live once.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..models.attention import Decode
from . import buffers


class SlotKV:
    """keys, values: `[layers, slots, kv_heads, capacity, head_dim]`."""

    def __init__(self, *, layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device):
        if min(layers, slots, kv_heads, capacity, head_dim) < 1:
            raise ValueError(f"every dimension of a slot cache must be >= 1, got layers {layers}, slots {slots}, "
                             f"kv_heads {kv_heads}, capacity {capacity}, head_dim {head_dim}")
        shape = (layers, slots, kv_heads, capacity, head_dim)
        self.keys = buffers.empty(shape, dtype, device).zero_()
        self.values = buffers.empty(shape, dtype, device).zero_()
        self._moved = self.keys.new_empty(0, head_dim)  # `_scratch`

    @property
    def slots(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def write(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows `0..n-1` of `slot` := keys, values `[layers, kv_heads, n, head_dim]` (a sequence
        joining, or rebuilt from its mirror)."""
        rows = keys.shape[2]
        if rows > self.capacity:
            raise ValueError(f"{rows} rows do not fit a slot of {self.capacity}")
        self.keys[:, slot, :, :rows] = keys.to(self.keys.device, self.keys.dtype)
        self.values[:, slot, :, :rows] = values.to(self.values.device, self.values.dtype)

    def read(self, slot: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of rows `0..rows-1` of `slot`: keys, values `[layers, kv_heads, rows, head_dim]`."""
        return self.keys[:, slot, :, :rows].clone(), self.values[:, slot, :, :rows].clone()

    def compact(self, slots: torch.Tensor, order: torch.Tensor, stored: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> None:
        """Row j of lane l of slot `slots[e]` := its row `order[e, l, j]` (`slots` [E], `order`
        [E, lanes, capacity]; lanes 1, layers, or layers × kv heads: a lane's rows move in
        every layer and kv head it spans). Only the rows that move are copied, keys and values
        each with one `index_select` and one `index_copy_` over the buffer's rows: an edit near
        a lane's end (a window row, a memory row) moves few, where a gather of whole slots
        copied every row of every layer three times.

        `stored`: keys, values `[E, J, layers, kv_heads, head_dim]` of rows coming back (recall):
        an `order` entry `capacity + j` takes row j of them, written (`index_copy_`) after the
        moves, in the lanes that name it."""
        layers, slots_total, kv_heads, capacity, head_dim = self.keys.shape
        edited, lanes = order.shape[:2]
        index = order.reshape(edited, -1, kv_heads if lanes == layers * kv_heads else 1, capacity)
        index = index.expand(-1, layers, kv_heads, -1).transpose(0, 1)  # [layers, E, kv_heads, capacity]
        moving = (index != torch.arange(capacity, device=index.device)) & (index < capacity)
        layer, entry, head, row = moving.nonzero(as_tuple=True)
        first = ((layer * slots_total + slots[entry]) * kv_heads + head) * capacity  # each lane's row 0, flat
        target, source = first + row, first + index[layer, entry, head, row]
        moved = self._scratch(len(source))
        for buffer in (self.keys, self.values):
            rows = buffer.view(-1, head_dim)
            rows.index_copy_(0, target, torch.index_select(rows, 0, source, out=moved))
        if stored is None:
            return
        layer, entry, head, row = (index >= capacity).nonzero(as_tuple=True)
        target = ((layer * slots_total + slots[entry]) * kv_heads + head) * capacity + row
        taken = index[layer, entry, head, row] - capacity
        for buffer, given in zip((self.keys, self.values), stored):
            buffer.view(-1, head_dim).index_copy_(0, target, given[entry, taken, layer, head].to(buffer.dtype))

    def _scratch(self, rows: int) -> torch.Tensor:
        """[rows, head_dim]: room for the rows an edit moves, kept from round to round (a fresh
        tensor each round cost its pages' first touch: SmolLM2's SmartKV lanes move ~140,000 rows
        a round at B = 8, and the copy took 2x as long)."""
        if self._moved.shape[0] < rows:
            self._moved = self.keys.new_empty(max(rows, self._moved.shape[0] * 3 // 2), self.keys.shape[-1])
        return self._moved[:rows]

    def move(self, source: int, target: int) -> None:
        """Slot `target` := slot `source` (the last sequence takes a leaving one's slot)."""
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]

    def cache(self, active: int, rows: torch.Tensor, mask: torch.Tensor) -> "SlotCache":
        """The Cache a forward of one new token for each of the first `active` slots runs over,
        writing slot s's token into its row `rows[s]` (`rows` [active] int64); `mask`
        [active, 1, 1, capacity] (additive) hides each slot's rows past its length."""
        return SlotCache(self, active, rows, mask)


class SlotLayer(CacheLayerMixin):
    """Layer `index` of the first `active` slots, for one decode forward."""

    is_sliding = False
    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                 mask: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values  # [active, kv_heads, capacity, head_dim] views
        self.slots, self.rows = slots, rows
        self.decode = Decode(keys, values, mask)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing: the buffers are allocated once, by SlotKV."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """New rows `[active, kv_heads, 1, head_dim]` -> each slot's row `rows[s]`; returns every
        row of every active slot as a `Decode` (as keys and as values), which the registered
        attention functions attend over with its mask, batch-invariantly."""
        if key_states.shape[2] != 1:
            raise ValueError(f"a slot cache's forward feeds one token per sequence, got {key_states.shape[2]}")
        self.keys[self.slots, :, self.rows] = key_states[:, :, 0]
        self.values[self.slots, :, self.rows] = value_states[:, :, 0]
        return self.decode, self.decode

    def get_seq_length(self) -> int:
        return 0  # never asked: the forward gives positions and a mask

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """The first `active` slots of a SlotKV as a transformers Cache, one SlotLayer per layer."""

    def __init__(self, kv: SlotKV, active: int, rows: torch.Tensor, mask: torch.Tensor):
        slots = torch.arange(active, device=rows.device)
        super().__init__(layers=[SlotLayer(kv.keys[layer, :active], kv.values[layer, :active], slots, rows, mask)
                                 for layer in range(kv.keys.shape[0])])
