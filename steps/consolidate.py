"""Step 3e: merge the repair actions and the generated token into one action list."""
from __future__ import annotations


def consolidate(add_token_id: int | None, repair_actions: list[dict]) -> list[dict]:
    """Return the tick's action list: the position-editing actions (copied, in the given
    order; Step 4 sorts them), then the `add` of the generated token if there is one.

    Raises ValueError if two actions touch the same row, naming both, or if an action is not a
    `replace_pair` / `delete` / `restore` / `drop`. Full type and range checks are Step 4's job; this step only
    guarantees the actions are independent of each other.
    """
    owner: dict[int, dict] = {}
    edits: list[dict] = []
    for action in repair_actions:
        for row in _rows(action):
            if row in owner:
                raise ValueError(f"row {row} is touched by two actions: {owner[row]!r} and {action!r}")
            owner[row] = action
        # Copy so later steps can never edit the caller's dicts (or id lists) behind its back.
        edits.append({k: _copy(v) for k, v in action.items()})
    if add_token_id is not None:
        if isinstance(add_token_id, bool) or not isinstance(add_token_id, int):
            raise ValueError(f"add_token_id must be an int or None, got {add_token_id!r}")
        edits.append({"action": "add", "token_id": add_token_id})
    return edits


def _rows(action: dict) -> range:
    kind = action.get("action") if isinstance(action, dict) else None
    try:
        if kind == "delete":
            return range(_pos(action["position"]), action["position"] + 1)
        if kind == "replace_pair":
            p1, p2 = _pos(action["original_pos1"]), _pos(action["original_pos2"])
            if p1 >= p2:
                raise ValueError(f"original_pos1 must be < original_pos2 in {action!r}")
            return range(p1, p2 + 1)
        if kind == "restore":
            return range(0)  # inserts between rows, touches none
        if kind == "drop":
            return range(0)  # names rows per layer (a per-layer state), not live rows
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed action {action!r}: {exc!r}") from None
    raise ValueError(f"consolidate takes only replace_pair, delete, restore and drop actions, got {action!r}")


def _copy(value):
    """Lists copied down to their items (a drop's rows are a list per layer)."""
    return [_copy(v) for v in value] if isinstance(value, list) else value


def _pos(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"position must be an int >= 0, got {value!r}")
    return value
