"""`scored`: llama.cpp's --kv-eviction 2, the least recently accessed rows go. A row is accessed
in a round when its share is at least the mean share of the non-sink rows, and when it is new
(llama.cpp stamps a cell when it is written); its value is the last round it was accessed."""

from __future__ import annotations

import torch

from .base import Press, mean_after_sinks


class ScoredPress(Press):
    """State "last" [S, N] float64: the round (clock + 1) a row was last accessed, new rows -1."""

    name = "scored"
    plain_rounds = True
    row_state = {"last": (torch.float64, -1.0)}

    def score(self, rows, state, clock):
        shares = rows.shares.to(torch.float64)
        # Equal shares are equally accessed: their mean can round a hair above them, so the
        # threshold gives way by a relative 1e-9, far below a float32 share's resolution.
        threshold = mean_after_sinks(shares, rows.length, self.settings.sinks) * (1 - 1e-9)
        last = state["last"]
        accessed = (shares >= threshold[:, None]) | (last < 0)
        last = torch.where(accessed, (clock + 1).to(torch.float64)[:, None], last)
        return last, {"last": last}
