"""`--policy brightness`: the halo rules (DESIGN §2 Step 2b). Each row's brightness follows the
attention it gets (ttl / vote, scorers.BrightnessScorer); at the budget the dimmest units are
culled, or repaired by the run's repairer (repairers.py)."""

from __future__ import annotations

from positronic import steps

from .base import Policy
from .repairers import make_repairer
from .scorers import BrightnessScorer


class BrightnessPolicy(Policy):
    """Unit: `config.unit_rows` (a repairer needs pairs); window: `config.window`; batch:
    `config.repair_batch` rows."""

    name = "brightness"
    removed = "culled"

    def __init__(self, lm, config):
        self.unit = config.unit_rows
        super().__init__(lm, config)
        self.repairer = make_repairer(config.repairer, lm, tokens=config.repair_tokens, margin=config.bridge_margin)

    def make_scorer(self, config):
        return BrightnessScorer(config)

    @classmethod
    def window(cls, config, length):
        return config.window

    @classmethod
    def batch(cls, config):
        """`evict_every` if set (BrainConfig.validate checks it fits), else `config.repair_batch`
        rows (1: one row a tick at the budget), fewer when a small budget leaves fewer free rows."""
        if config.evict_every:
            return config.evict_every
        free = steps.selectable_rows(config.budget, sinks=config.sinks, protect=config.protect,
                                     window=config.window)
        return max(1, min(config.repair_batch, len(free)))
