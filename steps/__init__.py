"""The tick's steps (DESIGN §2), each a pure function from inputs to outputs."""
from positronic.steps.attention import scores
from positronic.steps.brightness import RULES, TTL_START, VOTE_START, Rule, update_ttl, update_vote
from positronic.steps.consolidate import consolidate
from positronic.steps.sample import NonFiniteLogits, Sample, sample
from positronic.steps.units import protected_rows, select_units, selectable_rows

__all__ = [
    "RULES", "TTL_START", "VOTE_START", "NonFiniteLogits", "Rule", "Sample", "consolidate", "protected_rows", "sample",
    "scores", "select_units", "selectable_rows", "update_ttl", "update_vote",
]
