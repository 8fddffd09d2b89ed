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
from transformers.cache_utils import Cache

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


STORES = {"dynamic": DynamicStore}


def make_store(kind: str, num_layers: int) -> KVStore:
    try:
        return STORES[kind](num_layers)
    except KeyError:
        raise ValueError(f"unknown KV store {kind!r}; choose from {', '.join(STORES)}") from None
