"""Step 3e: the generated token and the policy's actions become the tick's one `Edit`."""
from __future__ import annotations

from positronic.state.edit import Bounds, Edit


def consolidate(add_token_id: int | None, repair_actions: list[dict], bounds: Bounds) -> Edit:
    """Return the tick's Edit: the policy's actions (in the given order; the Edit orders them
    for Step 4), then the `add` of the generated token if there is one, checked once against
    `bounds` (the state's: StateManager.bounds).

    Raises ActionError (a ValueError) naming the first action that is refused and why (two
    actions touching the same row name each other), ValueError if a policy action adds a
    token (the generated token is the tick's only add) or `add_token_id` is not an int or None.
    """
    for action in repair_actions:
        if isinstance(action, dict) and action.get("action") == "add":
            raise ValueError(f"consolidate takes only replace_pair, delete, restore and drop actions, got {action!r}")
    actions = list(repair_actions)
    if add_token_id is not None:
        if isinstance(add_token_id, bool) or not isinstance(add_token_id, int):
            raise ValueError(f"add_token_id must be an int or None, got {add_token_id!r}")
        actions.append({"action": "add", "token_id": add_token_id})
    return Edit.from_actions(actions, bounds)  # copies the actions: later steps never edit the caller's dicts
