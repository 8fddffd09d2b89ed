"""`h2o`: the Heavy-Hitter Oracle (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models"): a row's value is the attention it has
accumulated; the lightest middle rows go, the recent window protects the youngest."""

from __future__ import annotations

import torch

from .base import Press


class H2OPress(Press):
    """State "accumulated" [S, N] float64: the sum of every share a row received, new rows 0."""

    name = "h2o"
    plain_rounds = True
    row_state = {"accumulated": (torch.float64, 0.0)}

    def score(self, rows, state, clock):
        accumulated = state["accumulated"] + rows.shares.to(torch.float64)  # as `value.get(id, 0.0) + score`
        return accumulated, {"accumulated": accumulated}
