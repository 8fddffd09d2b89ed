"""Step 2b: update each live row's brightness from this tick's attention scores.

Pure Python on lists, one value per live row in cache order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

TTL_START = 255.0
VOTE_START = 10000.0


def update_ttl(
    brightness: list[float],
    scores: list[float],
    *,
    decay: float = 2.0,
    gain: float = 10.0,
    floor: float = 0.0,
    cap: float = 255.0,
) -> list[float]:
    """The "ttl" rule: b <- clamp(b - decay + gain*score, floor, cap) for every row."""
    _check_lengths(brightness, scores)
    return [min(cap, max(floor, b - decay + gain * s)) for b, s in zip(brightness, scores)]


def update_vote(
    brightness: list[float],
    scores: list[float],
    *,
    sinks: int = 4,
    cap: float = 10000.0,
) -> list[float]:
    """The "vote" rule: rows scoring above the mean of the non-sink rows gain floor(score/mean),
    all others lose 1; results clamped to [0, cap].

    Sinks take part in the vote but not in the mean, since their huge attention would
    raise the bar for everyone else. With no non-sink rows the mean is over all rows.
    If that mean is 0, any row with a positive score is infinitely above it: it goes to cap.
    """
    _check_lengths(brightness, scores)
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0, got {sinks}")
    pool = scores[sinks:] or scores
    threshold = sum(pool) / len(pool) if pool else 0.0
    out = []
    for b, s in zip(brightness, scores):
        if s > threshold:
            b = b + math.floor(s / threshold) if threshold > 0 else cap
        else:
            b = b - 1
        out.append(min(cap, max(0.0, b)))
    return out


@dataclass(frozen=True)
class Rule:
    """A brightness rule the loop can pick by name: new rows start at `start`;
    `update(brightness, scores, **options)` returns the new brightness list. `settings` maps
    each option the rule takes to the run setting (BrainConfig field) that supplies it."""

    name: str
    start: float
    update: Callable[..., list[float]]
    settings: tuple[tuple[str, str], ...] = ()


RULES: dict[str, Rule] = {
    "ttl": Rule("ttl", TTL_START, update_ttl, settings=(("decay", "ttl_decay"), ("gain", "ttl_gain"))),
    "vote": Rule("vote", VOTE_START, update_vote, settings=(("sinks", "sinks"),)),
}


def _check_lengths(brightness: list[float], scores: list[float]) -> None:
    if len(brightness) != len(scores):
        raise ValueError(
            f"brightness and scores must have one value per live row: "
            f"{len(brightness)} != {len(scores)}"
        )
