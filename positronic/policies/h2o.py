"""`--policy h2o`: the Heavy-Hitter Oracle, the rows with the least accumulated attention go."""

from __future__ import annotations

from .base import Policy
from .scorers import AccumulatedScorer


class H2OPolicy(Policy):
    """Keep the rows with the most accumulated attention plus the recent window; evict the
    lightest middle rows first, ties to the older row."""

    name = "h2o"

    def make_scorer(self, config):
        return AccumulatedScorer()

    def accumulated(self, ledger_id: int) -> float | None:
        return self.scorer.value.get(ledger_id)
