"""KV stores: the tensor blade of the knife.

A store holds every layer's keys and values, one row per live token, and offers the same
splices the live map has (delete at i, insert at i; appends happen when the model writes
through `store.cache`). The model reads the store through `store.cache`, a transformers
`Cache`. StateManager only talks to the `KVStore` interface, so backends can be swapped.

Shapes: one layer's keys/values are [batch=1, kv_heads, rows, head_dim]; a block of new
rows for all layers is [layers, 1, kv_heads, n, head_dim].
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from . import rope


class KVStore(ABC):
    """Every layer's K/V rows, edited only by splices."""

    cache: Cache

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values, [1, kv_heads, rows, head_dim]."""

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @abstractmethod
    def delete(self, row: int) -> None:
        """Remove `row` from every layer."""

    @abstractmethod
    def insert(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Insert a block [layers, 1, kv_heads, n, head_dim] before `row` in every layer."""

    @abstractmethod
    def rotate_keys(self, start: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Re-rotate the keys of rows start.. by cos/sin [rows - start, head_dim], in float32."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every row."""

    def check_block(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Raise ValueError unless keys/values are a block of new rows this store can take."""
        stored, _ = self.layer(0)
        expected = (self.num_layers, 1, stored.shape[1], None, stored.shape[3])
        for name, block in (("keys", keys), ("values", values)):
            shape = tuple(block.shape)
            if len(shape) != 5 or any(e is not None and e != s for e, s in zip(expected, shape)):
                want = "[" + ", ".join("n" if e is None else str(e) for e in expected) + "]"
                raise ValueError(f"new {name} have shape {list(shape)}, this store takes {want}")
            if block.dtype != stored.dtype or block.device != stored.device:
                raise ValueError(f"new {name} are {block.dtype} on {block.device}, the store holds "
                                 f"{stored.dtype} on {stored.device}")
        if keys.shape[3] != values.shape[3]:
            raise ValueError(f"{keys.shape[3]} new key rows but {values.shape[3]} value rows")

    def left_context(self, rows: int) -> Cache:
        """A separate cache holding rows [0, rows) that a forward may extend.

        The new rows a forward appends to it can then be read with `new_rows`; the store
        itself is not touched.
        """
        cache = DynamicCache()
        for index in range(self.num_layers):
            keys, values = self.layer(index)
            cache.update(keys[:, :, :rows], values[:, :, :rows], index)
        return cache

    def memory_usage_mb(self) -> float:
        total = 0
        for index in range(self.num_layers):
            keys, values = self.layer(index)
            total += keys.numel() * keys.element_size() + values.numel() * values.element_size()
        return total / 2**20


def new_rows(cache: Cache, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows start.. of every layer of `cache`, stacked: [layers, 1, kv_heads, n, head_dim]."""
    keys = torch.stack([layer.keys[:, :, start:] for layer in cache.layers])
    values = torch.stack([layer.values[:, :, start:] for layer in cache.layers])
    return keys, values


class DynamicStore(KVStore):
    """Reference backend: a transformers DynamicCache, spliced with torch.cat per layer.

    Simple and obviously right; every edit reallocates each layer. The preallocated
    backend is the fast one.
    """

    def __init__(self, num_layers: int):
        self._num_layers = num_layers
        self.cache = DynamicCache()

    @property
    def num_layers(self) -> int:
        return self._num_layers

    def __len__(self) -> int:
        return self.cache.get_seq_length() if self.cache.layers else 0

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.cache.layers[index]
        return layer.keys, layer.values

    def delete(self, row: int) -> None:
        for layer in self.cache.layers:
            layer.keys = torch.cat((layer.keys[:, :, :row], layer.keys[:, :, row + 1 :]), dim=2)
            layer.values = torch.cat((layer.values[:, :, :row], layer.values[:, :, row + 1 :]), dim=2)

    def insert(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.check_block(keys, values)
        for layer, k, v in zip(self.cache.layers, keys, values):
            layer.keys = torch.cat((layer.keys[:, :, :row], k, layer.keys[:, :, row:]), dim=2)
            layer.values = torch.cat((layer.values[:, :, :row], v, layer.values[:, :, row:]), dim=2)

    def rotate_keys(self, start: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        for layer in self.cache.layers:
            moved = rope.rotate(layer.keys[:, :, start:], cos, sin)
            layer.keys = torch.cat((layer.keys[:, :, :start], moved), dim=2)

    def reset(self) -> None:
        self.cache = DynamicCache()


class PreallocatedStore(KVStore):
    """Fast backend: one buffer for every layer, K and V, with a start and a length.

    buffer: [2 (keys, values), layers, kv_heads, capacity, head_dim]; buffer rows
    [start, start + length) are the live rows 0..length-1. An edit is one in-place row move
    for all layers at once, and it moves whichever side of the edited row is shorter: the
    rows before it (shifting `start`) or the rows after it. Maintenance mostly edits old rows
    near the front, so this usually moves a few dozen rows rather than the whole context.
    Appends write into spare capacity after the live rows; when that runs out the rows are
    packed back to buffer row 0, and only a full buffer doubles its capacity.
    """

    def __init__(self, num_layers: int, capacity: int = 1024):
        self._num_layers, self.capacity = num_layers, capacity
        self.buffer: torch.Tensor | None = None
        self.scratch: torch.Tensor | None = None  # like buffer: overlapping row moves go through it
        self.start = 0
        self.length = 0
        self.cache = Cache(layers=[_BufferLayer(self, index) for index in range(num_layers)])

    @property
    def num_layers(self) -> int:
        return self._num_layers

    def __len__(self) -> int:
        return self.length

    @property
    def end(self) -> int:
        """Buffer row just after the last live row: where the model writes new rows."""
        return self.start + self.length

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffer is None:
            raise IndexError("the store is empty")
        live = self.buffer[:, index, None, :, self.start : self.end]
        return live[0], live[1]

    def reserve(self, count: int, like: torch.Tensor) -> None:
        """Make room for `count` rows after the live ones; `like` ([1, kv_heads, n, head_dim])
        fixes dtype, device and shape. The model calls this from every layer's update, and
        only the first call of a forward (layer 0, before any layer wrote) can move rows."""
        if self.buffer is not None and self.end + count <= self.buffer.shape[3]:
            return
        if self.buffer is not None and self.length + count <= self.buffer.shape[3]:
            self._move_rows(self.start, self.end, 0)  # pack down into the free front rows
            self.start = 0
            return
        capacity = max(self.length + count, self.capacity if self.buffer is None else 2 * self.buffer.shape[3])
        shape = (2, self.num_layers, like.shape[1], capacity, like.shape[3])
        buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
        if self.buffer is not None:
            buffer[:, :, :, : self.length] = self.buffer[:, :, :, self.start : self.end]
        self.buffer, self.scratch, self.start = buffer, None, 0

    def _move_rows(self, first: int, stop: int, to: int) -> None:
        """Move buffer rows [first, stop) of every layer to start at buffer row `to`. The
        ranges may overlap, so the rows pass through `scratch`, which is kept: an edit then
        never allocates (on a CPU a fresh temporary costs 3x the copy itself in page faults)."""
        if stop <= first or first == to:
            return
        if self.scratch is None:
            self.scratch = torch.empty_like(self.buffer)
        rows = self.scratch[:, :, :, : stop - first]
        rows.copy_(self.buffer[:, :, :, first:stop])
        self.buffer[:, :, :, to : to + stop - first].copy_(rows)

    def delete(self, row: int) -> None:
        at = self.start + row
        if row < self.length - 1 - row:  # fewer rows before it: shift them right, start + 1
            self._move_rows(self.start, at, self.start + 1)
            self.start += 1
        else:
            self._move_rows(at + 1, self.end, at)
        self.length -= 1

    def insert(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.buffer is not None:
            self.check_block(keys, values)
        count = keys.shape[3]
        if self.buffer is not None and count <= self.start and row < self.length - row:
            self._move_rows(self.start, self.start + row, self.start - count)  # rows before it go left
            self.start -= count
        else:
            self.reserve(count, keys[0])
            self._move_rows(self.start + row, self.end, self.start + row + count)
        at = self.start + row
        self.buffer[:, :, :, at : at + count] = torch.stack((keys[:, 0], values[:, 0]))
        self.length += count

    def rotate_keys(self, start: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        keys = self.buffer[0, :, :, self.start + start : self.end]  # [layers, kv_heads, rows, head_dim]
        self.buffer[0, :, :, self.start + start : self.end] = rope.rotate(keys, cos, sin)

    def reset(self) -> None:
        self.start = self.length = 0

    def memory_usage_mb(self) -> float:
        """What the buffer and its scratch twin hold, spare capacity included."""
        held = [t for t in (self.buffer, self.scratch) if t is not None]
        return sum(t.numel() * t.element_size() for t in held) / 2**20


class _BufferLayer(CacheLayerMixin):
    """What the model sees of one layer of a PreallocatedStore: views of the shared buffer.

    A forward writes its new rows after the live ones in every layer; the last layer's
    write makes them live (all layers hold them by then).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, store: PreallocatedStore, index: int):
        self.store, self.index = store, index
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self.store.layer(self.index)[0]

    @property
    def values(self) -> torch.Tensor:
        return self.store.layer(self.index)[1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        store, count = self.store, key_states.shape[-2]
        store.reserve(count, key_states)
        end = store.end
        store.buffer[0, self.index, :, end : end + count] = key_states[0]
        store.buffer[1, self.index, :, end : end + count] = value_states[0]
        keys = store.buffer[0, self.index, None, :, store.start : end + count]
        values = store.buffer[1, self.index, None, :, store.start : end + count]
        if self.index == store.num_layers - 1:
            store.length += count
        return keys, values

    def get_seq_length(self) -> int:
        return self.store.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store.reset()


STORES = {"dynamic": DynamicStore, "preallocated": PreallocatedStore}


def make_store(kind: str, num_layers: int) -> KVStore:
    try:
        return STORES[kind](num_layers)
    except KeyError:
        raise ValueError(f"unknown KV store {kind!r}; choose from {', '.join(STORES)}") from None
