"""Step 3a: how many pairs to remove this tick."""
from __future__ import annotations

DEFAULT_BUDGET = 500


def cull_count(live_length: int, budget: int = DEFAULT_BUDGET) -> int:
    """0 below the budget, 1 at it, 2 above it.

    Removing at most two per tick (each tick adds one token) drains an overshoot
    gradually instead of stalling generation on a big clean-up.
    """
    for name, value in (("live_length", live_length), ("budget", budget)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if live_length < 0:
        raise ValueError(f"live_length must be >= 0, got {live_length}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if live_length < budget:
        return 0
    return 1 if live_length == budget else 2
