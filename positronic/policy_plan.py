"""What a policy hands back each tick (Steps 2b–3d), shared by every policy module."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PolicyPlan:
    """Actions for Step 3e and, per selected pair or row, what becomes of it, in words."""

    actions: list[dict] = field(default_factory=list)
    outcomes: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    stop: bool = False  # the policy cannot continue (e.g. `none` at capacity, asked to stop)
    brightness: list[float] | None = None  # Step 2b's new brightness, one per live row (None: unchanged)
