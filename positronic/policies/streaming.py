"""`--policy streaming`: StreamingLLM (llama.cpp --kv-eviction 1)."""

from __future__ import annotations

from .base import Policy
from .scorers import RecencyScorer


class StreamingPolicy(Policy):
    """Keep the sinks and the recent window; evict the oldest middle rows."""

    name = "streaming"

    def make_scorer(self, config):
        return RecencyScorer()
