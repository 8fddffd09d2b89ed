"""The tick's steps (DESIGN §2), each a pure function from inputs to outputs."""
from steps.attention import scores
from steps.brightness import RULES, TTL_START, VOTE_START, Rule, update_ttl, update_vote
from steps.consolidate import consolidate
from steps.cull import DEFAULT_BUDGET, cull_count
from steps.pairs import protected_rows, select_pairs, selectable_rows
from steps.repair import RepairPlan, Repairer, plan_repairs
from steps.sample import Sample, sample

__all__ = [
    "DEFAULT_BUDGET", "RULES", "TTL_START", "VOTE_START", "RepairPlan", "Repairer", "Rule",
    "Sample", "consolidate", "cull_count", "plan_repairs", "protected_rows", "sample",
    "scores", "select_pairs", "selectable_rows", "update_ttl", "update_vote",
]
