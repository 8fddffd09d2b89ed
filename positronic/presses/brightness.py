"""`brightness`: this project's halo rules (DESIGN §2 Step 2b, steps/brightness.py) on tensors.
Each row's brightness follows the attention it gets; at the budget the dimmest units go.

    ttl   b <- clamp(b - decay + gain * share, 0, 255), new rows 255
    vote  rows above the mean share of the non-sink rows gain floor(share / mean), the rest
          lose 1, clamped to [0, 10000], new rows 10000
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from positronic import steps

from .base import DEFAULT_WINDOW, Press, Settings, mean_after_sinks

TTL_CAP = 255.0  # update_ttl's cap and floor, which the ttl rule runs with
TTL_FLOOR = 0.0
VOTE_CAP = 10000.0  # update_vote's cap


@dataclass(frozen=True)
class BrightnessSettings(Settings):
    brightness: str = "ttl"  # the rule: ttl | vote
    ttl_decay: float = 2.0
    ttl_gain: float = 1000.0  # BrainConfig's (the rule's own default is 10; 1000 measured better)
    unit: int = 0  # rows selected together; 0: single rows (a pair only comes with a repairer, which presses lack)
    repair_batch: int = 8  # rows freed at once at the budget (fewer when fewer are selectable)

    def __post_init__(self):
        super().__post_init__()
        if self.brightness not in steps.RULES:
            raise ValueError(f"unknown brightness rule {self.brightness!r}; choose from {', '.join(steps.RULES)}")
        for name in ("ttl_decay", "ttl_gain"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name, least in (("unit", 0), ("repair_batch", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def ttl(brightness: Tensor, shares: Tensor, *, decay: float, gain: float) -> Tensor:
    """`steps.update_ttl` on [S, N] float64 (the same operations in the same order)."""
    return (brightness - decay + gain * shares).clamp(TTL_FLOOR, TTL_CAP)


def vote(brightness: Tensor, shares: Tensor, length: Tensor, *, sinks: int) -> Tensor:
    """`steps.update_vote` on [S, N] float64; a zero mean sends every row above it to the cap."""
    threshold = mean_after_sinks(shares, length, sinks)[:, None]
    gain = torch.where(threshold > 0, brightness + torch.floor(shares / threshold), VOTE_CAP)
    return torch.where(shares > threshold, gain, brightness - 1).clamp(0.0, VOTE_CAP)


class BrightnessPress(Press):
    """State "brightness" [S, N] float32, new rows at the rule's start. float32 because that is
    what a policy reads today (the mirror's brightness reaches it through a float32 view); the
    values it selects by are the float64 update, as today's list of floats."""

    name = "brightness"
    plain_rounds = True
    Settings = BrightnessSettings

    def __init__(self, settings):
        settings = BrightnessSettings.of(settings)
        self.unit = settings.unit or 1
        self.rule = steps.RULES[settings.brightness]
        self.row_state = {"brightness": (torch.float32, self.rule.start)}
        super().__init__(settings)

    def window(self, length):
        window = self.settings.window
        return torch.full_like(length, DEFAULT_WINDOW if window is None else window)

    def batch(self):
        """`evict_every` if set (`check` refuses more than can be selected), else `repair_batch`
        rows, fewer when a full cache leaves fewer selectable rows (at least 1)."""
        s = self.settings
        if s.evict_every:
            return s.evict_every
        free = steps.selectable_rows(s.budget, sinks=s.sinks, protect=s.protect, window=self.window_at(s.budget))
        return max(1, min(s.repair_batch, len(free)))

    def score(self, rows, state, clock):
        s, shares, before = self.settings, rows.shares.to(torch.float64), state["brightness"].to(torch.float64)
        if s.brightness == "ttl":
            values = ttl(before, shares, decay=float(s.ttl_decay), gain=float(s.ttl_gain))
        else:
            values = vote(before, shares, rows.length, sinks=s.sinks)
        return values, {"brightness": values.to(torch.float32)}
