"""`none`: no eviction. At capacity either stop (`at_capacity="stop"`) or do llama.cpp's context
shift (`"shift"`): when the live length has reached the budget, delete the older half of the
rows after the protected prefix (max(sinks, protect) rows, llama.cpp's n_keep), pinned rows
excepted, in one round. It keeps no state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Press, Settings


@dataclass(frozen=True)
class NoEvictionSettings(Settings):
    at_capacity: str = "shift"  # stop | shift

    def __post_init__(self):
        super().__post_init__()
        if self.at_capacity not in ("stop", "shift"):
            raise ValueError(f"at_capacity must be 'stop' or 'shift', got {self.at_capacity!r}")
        if self.evict_every:
            raise ValueError("evict_every applies to the shared-row policies, not none (it shifts half its rows when full)")


class NoEvictionPress(Press):
    """A row's value is its row: the shift takes the oldest rows after the prefix, and the
    recent window is empty, so the selection is exactly the shift's."""

    name = "none"
    Settings = NoEvictionSettings

    def check(self):
        """`none` never needs selectable rows: there is nothing to check."""

    def window(self, length):
        return torch.zeros_like(length)

    def batch(self):
        """0: `none` frees no fixed batch (the shift frees half, `due`)."""
        return 0

    def due(self, length):
        """shift: at the budget, half the rows after the protected prefix; stop: none."""
        if self.settings.at_capacity == "stop":
            return torch.zeros_like(length)
        keep = length.clamp(max=max(self.settings.sinks, self.settings.protect))
        return torch.where(length >= self.settings.budget, (length - keep) // 2, 0)

    def stops(self, length):
        """stop: the round whose add brings the live length to the budget is the last."""
        if self.settings.at_capacity == "stop":
            return length + 1 >= self.settings.budget
        return super().stops(length)

    def score(self, rows, state, clock):
        row = torch.arange(rows.shares.shape[1], device=rows.length.device, dtype=torch.float64)
        return row.expand(len(rows.length), -1), {}
