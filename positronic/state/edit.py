"""One edit of the state, in the one form every part of Step 4 reads: an `Edit`.

A policy speaks in action dicts (actions.py: the wire format of fixtures, events and the
API); `Edit.from_actions` checks a whole list once, against the `Bounds` of the state it is
meant for, and keeps what the list asks for in typed fields:

    deletes       live rows deleted on their own
    replacements  adjacent row pairs replaced by new tokens (a repair)
    restores      culled tokens brought back, `stored` with their own K/V when given
    drops         per-layer states: the rows each lane drops
    adds          tokens appended after the last row, in list order
    reread        the newest row's forward runs again after the other edits (no add then)

`insertions` turns it into the mirror's layout inputs (mirror.Insertion). What only the state
can check (that restored ids are culled tokens, that stored K/V fit the model, the tick's
brightness) the StateManager checks once when it applies the edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple

import torch

from positronic.mirror import Insertion

from ..util import is_int
from .actions import OPTIONAL, SCHEMA, ActionError, rows_of


@dataclass(frozen=True)
class Bounds:
    """What an action list is checked against: the state's live rows, the model's
    vocabulary and positions, and for a per-layer state (lanes, rows per lane)."""

    live_length: int
    vocab_size: int
    max_length: int
    layers: tuple[int, int] | None = None


@dataclass(frozen=True)
class Replacement:
    """Live rows `rows` (two adjacent rows) replaced by `token_ids` in the place of the first."""

    rows: tuple[int, int]
    token_ids: tuple[int, ...]


class StoredRow(NamedTuple):
    """A restored token's own K/V, as they were when it was culled."""

    keys: torch.Tensor  # [layers, kv_heads, head_dim]
    values: torch.Tensor  # [layers, kv_heads, head_dim]
    predicted: int  # the greedy next token its row's forward gave


@dataclass(frozen=True)
class Edit:
    """A checked action list (see the module docstring); build it with `from_actions`.
    `actions`: the list as given (copies), for observers and event logs; `final_length`:
    the live rows afterwards (per-layer states: the rows per lane)."""

    actions: tuple[dict, ...]
    bounds: Bounds
    final_length: int
    deletes: tuple[int, ...] = ()  # highest first
    replacements: tuple[Replacement, ...] = ()  # highest first
    restores: tuple[int, ...] = ()
    stored: Mapping[int, StoredRow] = field(default_factory=lambda: MappingProxyType({}))
    drops: tuple[tuple[int, ...], ...] | None = None
    adds: tuple[int, ...] = ()
    lanes: Mapping[int, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))  # restored id -> lanes
    reread: bool = False

    def lane_inserts(self) -> list[list[int]]:
        """Per-layer states: the ledger ids each lane takes back (ascending)."""
        inserts: list[list[int]] = [[] for _ in range(self.bounds.layers[0])]
        for ledger_id in sorted(self.lanes):
            for lane in self.lanes[ledger_id]:
                inserts[lane].append(ledger_id)
        return inserts

    @classmethod
    def from_actions(cls, actions, bounds: Bounds) -> "Edit":
        """Check a whole action list against `bounds`; ActionError names the first action
        (index and kind) that is refused and why."""
        return _validate(actions, bounds)

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def edits(self) -> list[dict]:
        """The position-editing actions, highest row first: the order that lets each edit
        leave the rows a later one names where they were."""
        edits = (action for action in self.actions if action["action"] in ("delete", "replace_pair"))
        return sorted(edits, key=lambda action: max(rows_of(action)), reverse=True)

    def deleted_rows(self) -> list[int]:
        """Live rows that go: deleted ones and replaced pairs."""
        return list(self.deletes) + [row for replacement in self.replacements for row in replacement.rows]

    def insertions(self, source: str, restorations: list[Insertion] = ()) -> list[Insertion]:
        """The layout's insertions: each replacement's tokens in the place of its first row,
        then `restorations` (the restores placed by the state, which knows their positions),
        then the adds after the last row, with ledger source `source`."""
        return ([Insertion(r.rows[0], r.token_ids, "repair", replaces=r.rows) for r in self.replacements]
                + list(restorations)
                + [Insertion(self.bounds.live_length, (token_id,), source) for token_id in self.adds])


def validate(actions, *, live_length: int, vocab_size: int, max_length: int,
             layers: tuple[int, int] | None = None) -> Edit:
    """`Edit.from_actions` with the bounds spelled out. layers: (layer count, rows per
    layer) of a per-layer state, which takes `add` (at most one) and one `drop` only; None:
    every layer holds the live rows, and `drop` is refused."""
    return Edit.from_actions(actions, Bounds(live_length, vocab_size, max_length, layers))


def _validate(actions, bounds: Bounds) -> Edit:
    if not isinstance(actions, list):
        raise ActionError(f"action list must be a list, got {type(actions).__name__}")
    live_length, vocab_size, layers = bounds.live_length, bounds.vocab_size, bounds.layers
    seen: dict[int, int] = {}  # row -> index of the action that edits it
    restored: dict[int, int] = {}  # ledger id -> index of the action that restores it
    stored: dict[int, StoredRow] = {}
    final_length = live_length if layers is None else layers[1]
    deletes, replacements, adds, drops = [], [], [], None
    reread = None  # index of the reread action
    lanes: dict[int, tuple[int, ...]] = {}  # per-layer states: restored ledger id -> the lanes taking it
    for index, action in enumerate(actions):
        name = action.get("action") if isinstance(action, dict) else None
        where = f"action {index} ({name})" if isinstance(name, str) else f"action {index}"

        def fail(problem: str):
            raise ActionError(f"{where}: {problem}")

        if not isinstance(action, dict):
            fail(f"must be a dict, got {type(action).__name__}")
        if name not in SCHEMA:
            fail(f"unknown action {name!r}; expected one of {', '.join(SCHEMA)}")
        if layers is None and name == "drop":
            fail("drop names rows per layer: this state keeps the same rows in every layer (use delete)")
        if layers is not None and name not in ("add", "drop", "restore", "reread"):
            fail("a per-layer state (layers keep different rows) takes add, drop, restore and reread actions only")
        expected = set(SCHEMA[name]) | set(OPTIONAL.get(name, ())) | {"action"}
        if unknown := sorted(set(map(str, action)) - expected):
            fail(f"unknown key(s) {', '.join(unknown)}")
        if missing := [key for key in SCHEMA[name] if key not in action]:
            fail(f"missing key(s) {', '.join(missing)}")

        def token(key: str, value) -> None:
            if not is_int(value):
                fail(f"{key} must be an int, got {type(value).__name__} {value!r}")
            if not 0 <= value < vocab_size:
                fail(f"{key}={value} is outside the vocabulary 0..{vocab_size - 1}")

        def row(key: str) -> int:
            value = action[key]
            if not is_int(value):
                fail(f"{key} must be an int, got {type(value).__name__} {value!r}")
            if not 0 <= value < live_length:
                fail(f"{key}={value} is out of range 0..{live_length - 1}")
            if value in seen:
                fail(f"{key}={value} is already edited by action {seen[value]}")
            return value

        if name == "add":
            token("token_id", action["token_id"])
            adds.append(action["token_id"])
            final_length += 1
        elif name == "restore":
            ids = action["ledger_ids"]
            if not isinstance(ids, list) or not ids or not all(is_int(i) and i >= 0 for i in ids):
                fail(f"ledger_ids must be a non-empty list of ledger ids (ints >= 0), got {ids!r}")
            for ledger_id in ids:
                if ledger_id in restored:
                    fail(f"ledger id {ledger_id} is already restored by action {restored[ledger_id]}")
                restored[ledger_id] = index
            given = [key for key in OPTIONAL["restore"] if key in action and key != "lanes"]
            if given:
                if len(given) != len(OPTIONAL["restore"]) - 1:
                    fail(f"keys, values and predicted come together (got only {', '.join(given)})")
                stored.update(_stored_rows(action, ids, vocab_size, fail))
            if layers is None:
                if "lanes" in action:
                    fail("lanes name the lanes of a per-layer state: this state keeps the same rows in every layer")
                final_length += len(ids)
            else:
                if not given:
                    fail("a per-layer state takes rows back with their own K/V (keys, values, predicted)")
                if "lanes" not in action:
                    fail("a per-layer state's restore names the lanes that take each token back (lanes)")
                lanes.update(_restore_lanes(action["lanes"], ids, layers[0], fail))
        elif name == "reread":
            if reread is not None:
                fail(f"the newest row is already reread by action {reread}")
            reread = index
        elif name == "drop":
            if drops is not None:
                fail("one drop action per list (it names every layer's rows)")
            drops = _layer_drops(action["rows"], layers, fail)
        elif name == "delete":
            deletes.append(row("position"))
            seen[deletes[-1]] = index
            final_length -= 1
        else:
            pos1, pos2 = row("original_pos1"), row("original_pos2")
            if pos1 >= pos2:
                fail(f"original_pos1={pos1} must be below original_pos2={pos2}")
            if pos2 != pos1 + 1:  # rows between would be neither kept in place nor replaced
                fail(f"original_pos1={pos1} and original_pos2={pos2} are not adjacent rows (a pair is pos1, pos1 + 1)")
            seen[pos1] = seen[pos2] = index
            new_ids = action["new_token_ids"]
            if not isinstance(new_ids, list) or not new_ids:
                fail(f"new_token_ids must be a non-empty list of ints, got {new_ids!r}")
            for token_id in new_ids:
                token("new_token_ids item", token_id)
            replacements.append(Replacement((pos1, pos2), tuple(new_ids)))
            final_length += len(new_ids) - 2
    if layers is not None:
        final_length += _lane_balance(drops, lanes, layers[0])
    if reread is not None:
        _check_reread(reread, actions[reread], adds, live_length, seen, drops, layers)
    if final_length < 1:
        raise ActionError(f"the action list would leave the context empty ({live_length} rows before)")
    if final_length > bounds.max_length:
        raise ActionError(f"the action list would grow the context to {final_length} rows, "
                          f"beyond the model's {bounds.max_length}")
    if layers is not None and len(adds) > 1:
        raise ActionError("a per-layer state adds at most one token per edit")
    return Edit(actions=tuple({key: _copy(value) for key, value in action.items()} for action in actions),
                bounds=bounds, final_length=final_length, deletes=tuple(sorted(deletes, reverse=True)),
                replacements=tuple(sorted(replacements, key=lambda r: r.rows, reverse=True)),
                restores=tuple(restored), stored=MappingProxyType(stored),
                drops=None if drops is None else tuple(map(tuple, drops)), adds=tuple(adds),
                lanes=MappingProxyType(lanes), reread=reread is not None)


def _check_reread(index: int, action: dict, adds: list[int], live_length: int, seen: dict[int, int],
                  drops: list[list[int]] | None, layers: tuple[int, int] | None) -> None:
    """A reread recomputes the newest row where it is: ActionError if the list adds a token
    (whose forward would be the newest) or takes the newest row out of some layer."""
    where = f"action {index} (reread)"
    if adds:
        raise ActionError(f"{where}: a list that adds a token runs the new token's forward, not the newest row's "
                          "again (reread or add, not both)")
    if live_length < 1:
        raise ActionError(f"{where}: there is no newest row to reread")
    last = live_length - 1 if layers is None else layers[1] - 1
    if layers is None and last in seen:
        raise ActionError(f"{where}: action {seen[last]} edits the newest row (row {last}), which a reread keeps")
    if layers is not None and drops is not None and any(last in dropped for dropped in drops):
        lane = next(lane for lane, dropped in enumerate(drops) if last in dropped)
        raise ActionError(f"{where}: the drop takes the newest row (row {last}) out of layer {lane}; a reread keeps it")


def _copy(value):
    """Lists copied down to their items (a drop's rows are a list per layer), so the caller's
    dicts and the edit's never share a list; tensors are shared (nobody writes them)."""
    return [_copy(v) for v in value] if isinstance(value, list) else value


def _layer_drops(rows, layers: tuple[int, int], fail) -> list[list[int]]:
    """A drop action's rows: one list per layer, the same length in every layer, each of
    distinct rows inside that layer."""
    count, length = layers
    if not isinstance(rows, list) or len(rows) != count or not all(isinstance(r, list) for r in rows):
        fail(f"rows must be a list of {count} lists (one per layer), got {type(rows).__name__}")
    for layer, dropped in enumerate(rows):
        if not all(is_int(r) and 0 <= r < length for r in dropped):
            fail(f"layer {layer}: rows must be ints in 0..{length - 1}, got {dropped!r}")
        if len(set(dropped)) != len(dropped):
            fail(f"layer {layer}: a row is dropped twice in {dropped!r}")
    return [list(dropped) for dropped in rows]


def _restore_lanes(lanes, ids: list[int], count: int, fail) -> dict[int, tuple[int, ...]]:
    """A per-layer restore's lanes: one non-empty list of distinct lanes per ledger id."""
    if not isinstance(lanes, list) or len(lanes) != len(ids) or not all(isinstance(l, list) and l for l in lanes):
        fail(f"lanes must be {len(ids)} non-empty lists of lanes (one per ledger id), got {lanes!r}")
    for ledger_id, taking in zip(ids, lanes):
        if not all(is_int(lane) and 0 <= lane < count for lane in taking) or len(set(taking)) != len(taking):
            fail(f"ledger id {ledger_id}: lanes must be distinct ints in 0..{count - 1}, got {taking!r}")
    return {ledger_id: tuple(sorted(taking)) for ledger_id, taking in zip(ids, lanes)}


def _lane_balance(drops: list[list[int]] | None, lanes: dict[int, tuple[int, ...]], count: int) -> int:
    """Rows each lane gains (negative: loses) by the drop and the restores; ActionError unless
    every lane ends with as many rows."""
    change = [0 if drops is None else -len(dropped) for dropped in (drops or [[]] * count)]
    for taking in lanes.values():
        for lane in taking:
            change[lane] += 1
    if len(set(change)) != 1:
        raise ActionError(f"every lane must end with as many rows: the drop and the restores change them by "
                          f"{sorted(set(change))} (a lane takes back as many tokens as it drops more rows)")
    return change[0]


def _stored_rows(action: dict, ids: list[int], vocab_size: int, fail) -> dict[int, StoredRow]:
    """A restore's own K/V, checked for form (their fit to the model is the StateManager's check)."""
    keys, values, predicted = action["keys"], action["values"], action["predicted"]
    for key, tensor in (("keys", keys), ("values", values)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 or tensor.shape[2] != len(ids):
            fail(f"{key} must be a tensor [layers, kv_heads, {len(ids)}, head_dim], got "
                 f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            fail(f"{key} must be finite floating-point values")
    if keys.shape != values.shape:
        fail(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
    if not isinstance(predicted, list) or len(predicted) != len(ids) \
            or not all(is_int(t) and 0 <= t < vocab_size for t in predicted):
        fail(f"predicted must be {len(ids)} token ids in the vocabulary, got {predicted!r}")
    return {ledger_id: StoredRow(keys[:, :, i], values[:, :, i], predicted[i]) for i, ledger_id in enumerate(ids)}
