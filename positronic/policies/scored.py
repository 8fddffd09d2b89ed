"""`--policy scored`: llama.cpp's --kv-eviction 2, the least recently accessed rows go."""

from __future__ import annotations

from .base import Policy
from .scorers import LastAccessScorer


class ScoredPolicy(Policy):
    """Evict the least recently accessed rows first, ties to the older row."""

    name = "scored"

    def make_scorer(self, config):
        return LastAccessScorer(sinks=config.sinks)

    def last_access(self, ledger_id: int) -> int | None:
        value = self.scorer.value.get(ledger_id)
        return None if value is None else int(value)
