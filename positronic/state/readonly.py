"""Read-only views of the two blades: what `StateManager.mirror` and `StateManager.cache` hand out.

Only the StateManager changes the KV cache or the mirror; everything else reads them through
these views, so a write from outside fails where it is made instead of desynchronising the
blades (tests/test_one_writer.py plants such writes and shows each is caught):

    MirrorView       ledger (LedgerView: entries as EntryViews), live (LiveMapView), layers
                     (LayerRowsView or None), ring (a Ring: frozen already), and the mirror's
                     reads (live_token_ids, live_texts, positions, brightness, check, ...)
    CacheView        any object of the cache side (the cache, its layers and their parts, the
                     row positions): plain attributes read through, tensors come out as clones
                     (writing to one changes nothing), and of the methods only the reads in
                     CACHE_READS can be called

Calling a method that changes a blade (`set_brightness`, `splice`, `update`, ...), reaching for
a private attribute (`_target`, `_write_rows`, ...) or assigning any attribute raises
ReadOnlyError, which names the attribute. A view wraps the live object: it costs one small
object per access and copies nothing but the tensors it is asked for; the forwards and every
edit use the private objects inside the state package, never these views.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Sequence
from types import MappingProxyType

import torch

from positronic.mirror import Ring, storage
from positronic.mirror.ledger import LedgerEntry


class ReadOnlyError(AttributeError):
    """A write (or a reach for something private) through a read-only view of a blade."""


class _View:
    """Base of the views: holds its target, refuses every assignment, and says which attribute a
    refused write or method was. `blade` names what the view shows, for the messages."""

    __slots__ = ("_target",)
    blade = "state"

    def __init__(self, target):
        object.__setattr__(self, "_target", target)

    def _refuse(self, name: str, what: str):
        return ReadOnlyError(f"`{name}` {what}: {type(self).__name__} is a read-only view of the {self.blade}; "
                             "only the StateManager changes it")

    def __setattr__(self, name, value):
        raise self._refuse(name, "cannot be assigned")

    def __delattr__(self, name):
        raise self._refuse(name, "cannot be deleted")

    def __getattr__(self, name):  # only for names the view does not offer
        if name.startswith("_") and not name.startswith("__"):
            raise self._refuse(name, "is private")
        if hasattr(self._target, name):
            raise self._refuse(name, "may change it")
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __copy__(self):
        return self  # nothing to copy: a view cannot change

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._target, memo)  # a copy of one's own, no longer the state's

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._target!r})"


class ReadOnlyList(Sequence):
    """A list of the blades, read in place: items come out through `wrap` (None: as they are, for
    lists of ints); a slice is a fresh list. Equal to any sequence with equal items."""

    __slots__ = ("_items", "_wrap")

    def __init__(self, items: list, wrap=None):
        object.__setattr__(self, "_items", items)
        object.__setattr__(self, "_wrap", wrap)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        item = self._items[index]
        if self._wrap is None:
            return item  # a slice of a list is already a fresh list
        return [self._wrap(i) for i in item] if isinstance(index, slice) else self._wrap(item)

    def __iter__(self):
        return iter(self._items) if self._wrap is None else map(self._wrap, self._items)

    def __contains__(self, value) -> bool:
        return value in self._items if self._wrap is None else super().__contains__(value)

    def index(self, value, *args) -> int:
        return self._items.index(value, *args) if self._wrap is None else super().index(value, *args)

    def count(self, value) -> int:
        return self._items.count(value) if self._wrap is None else super().count(value)

    def __eq__(self, other) -> bool:
        if not isinstance(other, (list, tuple, ReadOnlyList)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def _refuse(self, name: str):
        return ReadOnlyError(f"`{name}`: a read-only list of the state; only the StateManager changes it")

    def __setitem__(self, index, value):
        raise self._refuse("__setitem__")

    def __delitem__(self, index):
        raise self._refuse("__delitem__")

    def __iadd__(self, other):
        raise self._refuse("__iadd__")

    def __setattr__(self, name, value):
        raise self._refuse(name)

    def __getattr__(self, name):  # append, extend, sort, ...: what a list would change
        if hasattr(list, name) or name.startswith("_"):
            raise self._refuse(name)
        raise AttributeError(f"ReadOnlyList has no attribute {name!r}")

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._items, memo)

    def __repr__(self) -> str:
        return f"ReadOnlyList({list(self)!r})"


# --- the mirror ------------------------------------------------------------------------------


class EntryView(_View):
    """One LedgerEntry, read in place: its fields (replaced_by as a tuple). dataclasses.astuple
    and asdict read it as they read the entry."""

    __slots__ = ()
    blade = "ledger"
    __dataclass_fields__ = LedgerEntry.__dataclass_fields__
    replaced_by = property(lambda self: tuple(self._target.replaced_by))

    def __eq__(self, other) -> bool:
        if isinstance(other, EntryView):
            other = other._target
        return self._target == other if isinstance(other, LedgerEntry) else NotImplemented

    __hash__ = None


for _field in dataclasses.fields(LedgerEntry):  # a property per field: reads at attribute speed
    if _field.name != "replaced_by":
        setattr(EntryView, _field.name, property(operator.attrgetter(f"_target.{_field.name}")))


class LedgerView(_View):
    """The ledger: `entries` and `ledger[i]` as EntryViews, `len`, `count(state)`."""

    __slots__ = ()
    blade = "ledger"

    @property
    def entries(self) -> ReadOnlyList:
        return ReadOnlyList(self._target.entries, EntryView)

    def __len__(self) -> int:
        return len(self._target)

    def __getitem__(self, ledger_id: int) -> EntryView:
        return EntryView(self._target.entries[ledger_id])

    def __iter__(self):
        return map(EntryView, self._target.entries)

    def count(self, state: str) -> int:
        return self._target.count(state)

    def column(self, name: str) -> list:
        """One field of every entry, by ledger id (a fresh list): what a pass over `entries`
        would read, without a view per entry."""
        if name not in LedgerEntry.__dataclass_fields__:
            raise AttributeError(f"a ledger entry has no field {name!r}")
        values = list(map(operator.attrgetter(name), self._target.entries))
        return [list(ids) for ids in values] if name == "replaced_by" else values


class LiveMapView(_View):
    """The live map: `ledger_ids` and `positions` [rows], read in place."""

    __slots__ = ()
    blade = "live map"
    ledger_ids = property(lambda self: ReadOnlyList(self._target.ledger_ids))
    positions = property(lambda self: ReadOnlyList(self._target.positions))

    def __len__(self) -> int:
        return len(self._target)


class LayerRowsView(_View):
    """Per-layer rows: `rows[l]` (ledger ids), `counts`, `num_layers`, `len`, and the reads."""

    __slots__ = ()
    blade = "per-layer rows"
    rows = property(lambda self: ReadOnlyList(self._target.rows, ReadOnlyList))
    counts = property(lambda self: MappingProxyType(self._target.counts))
    num_layers = property(lambda self: self._target.num_layers)

    def __len__(self) -> int:
        return len(self._target)

    def occupancy(self, ledger_ids: list[int]) -> list[int]:
        return self._target.occupancy(ledger_ids)

    def held(self) -> set[int]:
        return self._target.held()

    def check(self, union_ids) -> None:
        self._target.check(list(union_ids))


class MirrorView(_View):
    """The mirror, read in place: ledger, live, layers, ring and the mirror's reads (fresh lists).
    `copy()` (and copy.deepcopy) give a Mirror of one's own, to resume another state from."""

    __slots__ = ()
    blade = "mirror"
    ledger = property(lambda self: LedgerView(self._target.ledger))
    live = property(lambda self: LiveMapView(self._target.live))
    layers = property(lambda self: None if self._target.layers is None else LayerRowsView(self._target.layers))
    ring = property(lambda self: self._target.ring)  # a Ring is frozen

    def __len__(self) -> int:
        return len(self._target)

    def live_token_ids(self) -> list[int]:
        return self._target.live_token_ids()

    def live_texts(self) -> list[str]:
        return self._target.live_texts()

    def positions(self) -> list[int]:
        return self._target.positions()

    def brightness(self) -> list[float]:
        return self._target.brightness()

    def layer_positions(self, layer: int) -> list[int]:
        return self._target.layer_positions(layer)

    def layer_rows_of(self, layer: int) -> list[int]:
        return self._target.layer_rows_of(layer)

    def check(self, max_position: int | None = None) -> None:
        self._target.check(max_position)

    def columns(self) -> dict:
        """The mirror as plain data (storage.to_columns: fresh lists, nothing shared)."""
        return storage.to_columns(self._target)

    def to_bytes(self, meta: dict | None = None) -> bytes:
        """The mirror file's bytes (storage.to_bytes), for storage.write_atomic."""
        return storage.to_bytes(self._target, meta)

    def to_chunks(self, meta: dict | None = None) -> list[bytes]:
        """The same bytes in pieces (storage.to_chunks), for storage.write_atomic without a copy."""
        return storage.to_chunks(self._target, meta)

    def copy(self):
        """A deep copy: a Mirror nothing else holds, free to change."""
        return copy.deepcopy(self._target)


# --- the cache -------------------------------------------------------------------------------

# the cache side's methods a view may call: they read (and return fresh results); every other
# method (splice, fill, update, reset, reserve, crop, rotate_keys, set_positions, set_ring, ...)
# may change the cache
CACHE_READS = frozenset({
    "memory_bytes", "memory_usage_mb", "get_seq_length", "get_max_length", "get_mask_sizes",
    "slot_index", "slot_rows", "slots_of", "coded_keys", "coded_values",
})
_AS_IS = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size, Ring)


def cache_view(value):
    """`value` (something reached from the cache) as a reader may have it: tensors cloned,
    lists and dicts read-only, objects as CacheViews, immutable values as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, _AS_IS):
        return value
    if isinstance(value, (list, tuple)):
        return ReadOnlyList(value, cache_view)
    if isinstance(value, dict):
        return MappingProxyType({key: cache_view(item) for key, item in value.items()})
    return CacheView(value)


class CacheView(_View):
    """The cache, a layer of it, a part of a packed layer, ...: attributes and properties read
    through `cache_view` (so `layer.keys` is a clone, `cache.layers` a read-only list of
    CacheViews), the methods in CACHE_READS run on the real object, everything else refuses."""

    __slots__ = ()
    blade = "KV cache"

    def __getattr__(self, name):
        if name.startswith("_"):
            raise self._refuse(name, "is private")
        value = getattr(self._target, name)
        if callable(value) and not isinstance(value, (type, torch.Tensor)):
            if name not in CACHE_READS:
                raise self._refuse(name, "may change it")
            return lambda *args, **kwargs: cache_view(value(*args, **kwargs))
        return cache_view(value)

    def __len__(self) -> int:
        return len(self._target)

    def __bool__(self) -> bool:
        return bool(self._target)

    def __getitem__(self, index):
        return cache_view(self._target[index])

    def __iter__(self):
        return map(cache_view, iter(self._target))
