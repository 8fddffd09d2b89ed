"""`streaming`: StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with
Attention Sinks"), llama.cpp's --kv-eviction 1: keep the sinks and the recent window, the
oldest middle rows go."""

from __future__ import annotations

import torch

from .base import Press


class StreamingPress(Press):
    """A row's value is its RoPE position: the oldest go first."""

    name = "streaming"
    plain_rounds = True

    def score(self, rows, state, clock):
        return rows.positions.to(torch.float64), {}
