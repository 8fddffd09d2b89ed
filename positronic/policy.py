"""Maintenance policies: what to cut from the context this tick (DESIGN §2 Steps 2b–3d, §5).

A policy sees a read-only view of the context (`ContextView`) and this tick's attention
scores (one per live row) and returns position-editing actions, plus the new brightness if
it keeps one; Step 3e adds the generated token and Step 4 (`StateManager.apply`) applies
everything, whatever the policy. A policy never touches the StateManager. Per-token state a
policy keeps (brightness lives in the mirror; other policies key theirs by ledger id)
survives every splice.
"""

from __future__ import annotations

import time
from typing import Protocol

import steps

from .eviction import EVICTION_POLICIES
from .policy_plan import PolicyPlan
from .repairers import make_repairer


class Policy(Protocol):
    def plan(self, view, scores: list[float], seconds: dict[str, float]) -> PolicyPlan:
        """Decide this tick's edits; may record its sub-step timings in `seconds`."""
        ...


class BrightnessPolicy:
    """The halo rules: brightness from attention, then repair or cull the dimmest pairs."""

    def __init__(self, lm, config):
        self.config = config
        self.rule = steps.RULES[config.brightness]
        self.options = {"sinks": config.sinks} if self.rule.uses_sinks else {}
        self.repairer = make_repairer(config.repairer, lm, tokens=config.repair_tokens)

    def plan(self, view, scores: list[float], seconds: dict[str, float]) -> PolicyPlan:
        cfg = self.config
        clock = time.perf_counter()
        brightness = self.rule.update(view.brightness.tolist(), scores, **self.options)
        length = len(brightness)
        count = steps.cull_count(length, cfg.budget)
        if count:  # a batch: the extra pairs buy ticks with no edit (see BrainConfig.repair_batch)
            count += cfg.repair_batch - 1
        pairs = steps.select_pairs(brightness, count, sinks=cfg.sinks,
                                   protect=cfg.protect, window=cfg.window)
        seconds["brightness"] = (now := time.perf_counter()) - clock
        proposals = [self.repairer.propose(view, pair) for pair in pairs]
        repairs = steps.plan_repairs(pairs, proposals, must_meet_budget=length > cfg.budget)
        seconds["repair"] = time.perf_counter() - now
        return PolicyPlan(repairs.actions, [(pair, outcome) for pair, outcome in repairs.outcomes],
                          brightness=brightness)


POLICIES = {"brightness": BrightnessPolicy, **EVICTION_POLICIES}  # streaming, scored, h2o, none


def make_policy(name: str, lm, config) -> Policy:
    """The policy `name` for a run of `lm` with `config`."""
    try:
        return POLICIES[name](lm, config)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
