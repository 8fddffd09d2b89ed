"""`--policy none`: no eviction; at capacity stop, or do llama.cpp's context shift."""

from __future__ import annotations

from .base import Policy, PolicyPlan, pinned_rows


class NoEvictionPolicy:
    """No eviction. When the cache is full (`config.at_capacity`):

    - `stop`: at the tick whose add brings the live length to the budget the plan says stop;
      the Runner (or the evaluator) ends the run after that tick, with the cache exactly full.
    - `shift`: llama.cpp's context shift. When the live length has reached the budget, discard
      the older half of the rows after the protected prefix (`max(sinks, protect)` rows, like
      llama.cpp's n_keep) and the pinned rows, in one batch of deletes. The rows keep their
      RoPE positions.

    It keeps no state from tick to tick: its plans' next state is None.
    """

    name = "none"
    per_layer = reads_keys = False
    recall = repairer = None
    default_window = Policy.default_window

    def __init__(self, lm, config):
        self.config = config
        if config.at_capacity not in ("stop", "shift"):
            raise ValueError(f"at_capacity must be 'stop' or 'shift', got {config.at_capacity!r}")

    @classmethod
    def check(cls, config) -> None:
        """`none` never needs free rows; it never evicts, so there is nothing to recall."""
        if getattr(config, "recall", False):
            raise ValueError("recall brings evicted rows back: policy none evicts nothing (choose another policy)")

    def commit(self, next, probe_logprobs=None) -> None:
        """`none` keeps no state."""

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        if state != {}:
            raise ValueError("policy none keeps no state")

    def plan(self, view, scores: list[float], seconds: dict[str, float], *, typed: bool = False) -> PolicyPlan:
        length, budget = len(scores), self.config.budget
        if self.config.at_capacity == "stop":
            if length + 1 >= budget:
                return PolicyPlan(outcomes=[((), f"cache full ({budget} rows): stopping")], stop=True)
            return PolicyPlan()
        if length < budget:
            return PolicyPlan()
        return self.prune(view, scores, length - (length - self._keep(length)) // 2)

    def prune(self, view, scores: list[float], target: int) -> PolicyPlan:
        """Shift out the oldest rows after the protected prefix, down to `target` rows."""
        length, pinned = len(scores), set(pinned_rows(view))
        keep = self._keep(length)
        rows = [row for row in range(keep, length) if row not in pinned][: max(0, length - target)]
        return PolicyPlan([{"action": "delete", "position": row} for row in rows],
                          [((row,), "shifted out") for row in rows])

    def _keep(self, length: int) -> int:
        return min(max(self.config.sinks, self.config.protect), length)
