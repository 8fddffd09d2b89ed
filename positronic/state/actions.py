"""The Step 3e → Step 4 contract: action dicts, their validation, and their order.

Actions are plain dicts (DESIGN §3):
    {'action': 'add',          'token_id': int}
    {'action': 'replace_pair', 'original_pos1': int, 'original_pos2': int, 'new_token_ids': [int, ...]}
    {'action': 'delete',       'position': int}
    {'action': 'drop',         'rows': [[int, ...] per layer]}   per-layer rows only (SmartKV):
       layer l drops its rows rows[l] (row numbers in that layer's cache); every layer drops
       as many, so all layers keep the same length. A per-layer state takes add and drop only.
    {'action': 'restore',      'ledger_ids': [int, ...]}   culled tokens back at their old positions
       optional with the rows' K/V as they were when culled (all three or none; without them
       Step 4 recomputes the K/V in the tick's forward, seeing only today's left context):
       'keys', 'values': tensors [layers, kv_heads, len(ledger_ids), head_dim]
       'predicted':     [int, ...] the greedy next token each row's forward gave (ContextView.predicted)
Positions are live rows before the tick's edits. A whole list is validated before anything
is touched; then position edits run in strictly descending order of their highest row (so
no edit moves a row a later edit refers to) and adds run last, in list order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..util import is_int

SCHEMA = {
    "add": ("token_id",),
    "replace_pair": ("original_pos1", "original_pos2", "new_token_ids"),
    "delete": ("position",),
    "restore": ("ledger_ids",),
    "drop": ("rows",),
}
OPTIONAL = {"restore": ("keys", "values", "predicted")}  # all of them or none


class ActionError(ValueError):
    """An action list that Step 4 refuses; the state was not touched."""


@dataclass(frozen=True)
class Plan:
    """A validated action list: `edits` in the order to apply them, then `adds`; `restored`:
    the ledger ids the restore actions bring back (their checks against the ledger are the
    StateManager's: this module does not see it)."""

    edits: list[dict]
    adds: list[dict]
    final_length: int
    restored: tuple[int, ...] = ()
    stored: dict = field(default_factory=dict)  # ledger id -> (keys [layers, kv_heads, head_dim], values, predicted)
    drops: list[list[int]] | None = None  # per-layer rows: each layer's dropped rows (None: no drop action)


def loggable(action: dict) -> dict:
    """The action as plain data for an event log: a restore's K/V are summarised by their
    shape (`"stored": [layers, kv_heads, rows, head_dim]`), everything else is as given."""
    if action.get("action") != "restore" or "keys" not in action:
        return dict(action)
    return {"action": "restore", "ledger_ids": list(action["ledger_ids"]), "stored": list(action["keys"].shape)}


def rows_of(action: dict) -> tuple[int, ...]:
    """The live rows an action edits (none for an add)."""
    if action["action"] == "replace_pair":
        return (action["original_pos1"], action["original_pos2"])
    if action["action"] == "delete":
        return (action["position"],)
    return ()


def validate(actions, *, live_length: int, vocab_size: int, max_length: int,
             layers: tuple[int, int] | None = None) -> Plan:
    """Check a whole action list against the current state and return the order to apply it.

    Raises ActionError naming the action (index and kind) and the problem.
    layers: (layer count, rows per layer) of a per-layer state, which takes `add` and one
    `drop` only; `final_length` is then the rows per layer afterwards. None: every layer
    holds the live rows, and `drop` is refused.
    """
    if not isinstance(actions, list):
        raise ActionError(f"action list must be a list, got {type(actions).__name__}")
    seen: dict[int, int] = {}  # row -> index of the action that edits it
    restored: dict[int, int] = {}  # ledger id -> index of the action that restores it
    stored: dict[int, tuple] = {}
    final_length = live_length if layers is None else layers[1]
    drops = None
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
        if layers is not None and name not in ("add", "drop"):
            fail("a per-layer state (layers keep different rows) takes add and drop actions only")
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
            final_length += 1
        elif name == "restore":
            ids = action["ledger_ids"]
            if not isinstance(ids, list) or not ids or not all(is_int(i) and i >= 0 for i in ids):
                fail(f"ledger_ids must be a non-empty list of ledger ids (ints >= 0), got {ids!r}")
            for ledger_id in ids:
                if ledger_id in restored:
                    fail(f"ledger id {ledger_id} is already restored by action {restored[ledger_id]}")
                restored[ledger_id] = index
            final_length += len(ids)
            given = [key for key in OPTIONAL["restore"] if key in action]
            if given:
                if len(given) != len(OPTIONAL["restore"]):
                    fail(f"keys, values and predicted come together (got only {', '.join(given)})")
                stored.update(_stored_rows(action, ids, vocab_size, fail))
        elif name == "drop":
            if drops is not None:
                fail("one drop action per list (it names every layer's rows)")
            drops = _layer_drops(action["rows"], layers, fail)
            final_length -= len(drops[0])
        elif name == "delete":
            seen[row("position")] = index
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
            final_length += len(new_ids) - 2
    if final_length < 1:
        raise ActionError(f"the action list would leave the context empty ({live_length} rows before)")
    if final_length > max_length:
        raise ActionError(f"the action list would grow the context to {final_length} rows, beyond the model's {max_length}")
    edits = sorted((a for a in actions if a["action"] in ("delete", "replace_pair")), key=lambda a: max(rows_of(a)),
                   reverse=True)
    adds = [a for a in actions if a["action"] == "add"]
    return Plan(edits=edits, adds=adds, final_length=final_length, restored=tuple(restored), stored=stored,
                drops=drops)


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
    if len({len(dropped) for dropped in rows}) != 1:
        fail(f"every layer must drop as many rows (got {sorted({len(d) for d in rows})}): "
             "the layers keep the same length")
    return [list(dropped) for dropped in rows]


def _stored_rows(action: dict, ids: list[int], vocab_size: int, fail) -> dict[int, tuple]:
    """A restore's own K/V, checked for form (their fit to the model is Step 4's check)."""
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
    return {ledger_id: (keys[:, :, i], values[:, :, i], predicted[i]) for i, ledger_id in enumerate(ids)}
