"""`--policy random`: evict uniformly at random among the selectable rows, the reproducible
baseline papers report next to every eviction policy.

Each tick every live row draws a uniform value from the policy's own generator, seeded with
the run's seed; the shared selector takes the lowest, so the rows that go are a uniform
sample of what the protected-rows rule leaves (sinks, protected prefix, recent window, pins).
The generator is the scorer's state: a plan draws from a copy, which becomes current only
when the tick commits, and a session saves it, so a retried or resumed tick draws exactly
what the uninterrupted run drew.
"""

from __future__ import annotations

import torch

from .base import Policy
from .scorers import Scorer


class RandomScorer(Scorer):
    """A uniform value in [0, 1) per live row; the state is the generator's."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def plan(self, view, scores):
        generator = torch.Generator()
        generator.set_state(self.generator.get_state())  # the current generator draws nothing until commit
        return torch.rand(len(view), generator=generator).tolist(), generator

    def adopt(self, next):
        self.generator = next

    def state(self):
        return {"generator": self.generator.get_state().numpy().tobytes()}

    def load_state(self, state):
        generator = torch.Generator()
        try:
            if not (isinstance(state, dict) and set(state) == {"generator"} and isinstance(state["generator"], bytes)):
                raise TypeError
            generator.set_state(torch.frombuffer(bytearray(state["generator"]), dtype=torch.uint8))
        except (TypeError, RuntimeError, ValueError):
            raise ValueError("RandomScorer: malformed saved state") from None
        self.generator = generator


class RandomPolicy(Policy):
    """Uniformly random rows go, one batch at the budget (llama.cpp's window and batch, as
    streaming, scored and h2o), so it differs from them only in which rows."""

    name = "random"

    def make_scorer(self, config):
        return RandomScorer(config.seed)
