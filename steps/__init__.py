"""The tick's steps (DESIGN §2), each a pure function from inputs to outputs."""
from steps.attention import scores
from steps.brightness import RULES, TTL_START, VOTE_START, Rule, update_ttl, update_vote
from steps.consolidate import consolidate
from steps.sample import Sample, sample
from steps.units import protected_rows, select_units, selectable_rows

__all__ = [
    "RULES", "TTL_START", "VOTE_START", "Rule", "Sample", "consolidate", "protected_rows", "sample",
    "scores", "select_units", "selectable_rows", "update_ttl", "update_vote",
]
