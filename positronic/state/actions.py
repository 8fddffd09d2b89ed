"""The Step 3e → Step 4 contract: action dicts, the wire format of an edit.

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
       per-layer rows (SmartKV): also 'lanes': [[int, ...] per ledger id], the lanes that take
       each token back (a lane holds it nowhere else; K/V are then required). Every lane ends
       with as many rows: a lane takes back as many tokens as its drop names more rows.
    {'action': 'reread'}   the newest row's forward again, over the rows the list's other edits
       leave (recall's rows back): its K/V in every layer and the next token's logits made anew;
       its token, ledger entry and position stay. Not with an add; the newest row must stay in
       every layer (recall's look comes right after the forward that wrote it, and the token
       that look was for is predicted with what it brought back).
Positions are live rows before the tick's edits. A whole list is checked before anything
is touched, once, when it becomes an `Edit` (edit.py); then position edits run in strictly
descending order of their highest row (so no edit moves a row a later edit refers to) and
adds run last, in list order.
"""

from __future__ import annotations

SCHEMA = {
    "add": ("token_id",),
    "replace_pair": ("original_pos1", "original_pos2", "new_token_ids"),
    "delete": ("position",),
    "restore": ("ledger_ids",),
    "drop": ("rows",),
    "reread": (),
}
OPTIONAL = {"restore": ("keys", "values", "predicted", "lanes")}  # K/V: all of them or none; lanes: per-layer rows


class ActionError(ValueError):
    """An action list that Step 4 refuses; the state was not touched."""


def loggable(action: dict) -> dict:
    """The action as plain data for an event log: a restore's K/V are summarised by their
    shape (`"stored": [layers, kv_heads, rows, head_dim]`), everything else is as given."""
    if action.get("action") != "restore" or "keys" not in action:
        return dict(action)
    logged = {"action": "restore", "ledger_ids": list(action["ledger_ids"]), "stored": list(action["keys"].shape)}
    return logged | ({"lanes": [list(lanes) for lanes in action["lanes"]]} if "lanes" in action else {})


def rows_of(action: dict) -> tuple[int, ...]:
    """The live rows an action edits (none for an add)."""
    if action["action"] == "replace_pair":
        return (action["original_pos1"], action["original_pos2"])
    if action["action"] == "delete":
        return (action["position"],)
    return ()
