"""Scorers: one value per live row each tick, lower = less worth keeping (kvpress's "press score").

A scorer turns the newest token's attention over the live rows (`scores`, one float per row,
Step 2a) into `values`, one float per row in cache order; the policy's one selector
(`steps.select_units`) then takes the lowest units. Per-row state is either in the mirror
(brightness) or keyed by ledger id, so it follows a row through every splice.

    BrightnessScorer   the halo rules ttl / vote (DESIGN §2 Step 2b); the values ARE the new brightness
    RecencyScorer      the RoPE position: the oldest rows are the lowest (StreamingLLM)
    LastAccessScorer   the tick a row was last attended above the mean (llama.cpp --kv-eviction 2)
    AccumulatedScorer  the sum of every score a row received (H2O's heavy hitters)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from positronic import steps

from ..util import is_int_list


class Scorer:
    """Base: `plan(view, scores)` once per tick returns the values and the scorer's state after
    the tick, which becomes current only at `adopt` (once the tick went through); nothing
    changes while it plans. `removing(next, ledger_ids)` tells that next state which rows the
    tick's plan takes out (a scorer with per-row state forgets them once they are gone)."""

    keeps_brightness = False  # True: the values are stored as the rows' new brightness

    def plan(self, view, scores: list[float]) -> tuple[list[float], object]:
        """One value per live row in cache order, and the next state (None: it keeps none)."""
        raise NotImplementedError

    def values(self, view, scores: list[float]) -> list[float]:
        """`plan` and `adopt` at once: the values of a tick that is taken to go through."""
        values, next = self.plan(view, scores)
        self.adopt(next)
        return values

    def removing(self, next, ledger_ids: list[int]) -> None:
        """The tick of `next` takes these rows out (if it goes through)."""

    def adopt(self, next) -> None:
        """The tick whose plan returned `next` went through: its state becomes current."""

    def state(self) -> dict:
        """The per-row state as plain data (msgpack-able), for a session checkpoint."""
        return {}

    def load_state(self, state: dict) -> None:
        """Take a `state()` back; ValueError naming what is malformed (nothing changes then)."""
        if state != {}:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state) if isinstance(state, dict) else state!r}")


class BrightnessScorer(Scorer):
    """Brightness from attention with a rule of `steps.RULES`; new rows start at the rule's start.
    The state is the rows' brightness, kept in the mirror (the plan's values go to Step 4)."""

    keeps_brightness = True

    def __init__(self, config):
        self.rule = steps.RULES[config.brightness]
        self.options = {option: getattr(config, setting) for option, setting in self.rule.settings}

    def plan(self, view, scores):
        return self.rule.update(view.brightness.tolist(), scores, **self.options), None


class RecencyScorer(Scorer):
    """A row's RoPE position: the oldest middle rows go first."""

    def plan(self, view, scores):
        return [float(p) for p in view.positions.tolist()], None


@dataclass
class Keyed:
    """A keyed scorer's state: a number per ledger id, the ticks so far, and the rows the last
    tick took out (forgotten at the next plan, once they are really gone)."""

    value: dict[int, float] = field(default_factory=dict)
    clock: int = 0
    removing: list[int] = field(default_factory=list)


class KeyedScorer(Scorer):
    """A number per row, keyed by ledger id, so it follows a row through every splice. A plan
    works on its own copy of the numbers (one dict copy a tick): a tick that failed or was
    interrupted never adopts it, and running it again does not count it twice."""

    def __init__(self):
        self.current = Keyed()

    @property
    def value(self) -> dict[int, float]:
        return self.current.value

    @property
    def clock(self) -> int:
        return self.current.clock

    def plan(self, view, scores):
        ids = view.ledger_ids.tolist()
        if len(scores) != len(ids):
            raise ValueError(f"{len(scores)} scores for {len(ids)} live rows")
        value, clock = dict(self.current.value), self.current.clock + 1
        if self.current.removing:
            live = set(ids)
            for ledger_id in self.current.removing:
                if ledger_id not in live:
                    value.pop(ledger_id, None)
        self.observe(value, clock, ids, scores)
        if len(value) > 2 * len(ids) + 64:  # rows that left some other way: never grows unbounded
            live = set(ids)
            value = {k: v for k, v in value.items() if k in live}
        return [value[i] for i in ids], Keyed(value, clock)

    def removing(self, next, ledger_ids):
        next.removing = list(ledger_ids)

    def adopt(self, next):
        self.current = next

    def observe(self, value: dict[int, float], clock: int, ids: list[int], scores: list[float]) -> None:
        """Update `value` (the next state's own dict) with tick `clock`'s scores."""
        raise NotImplementedError

    def state(self):
        return {"ids": list(self.value), "values": list(self.value.values()), "clock": self.clock,
                "removing": list(self.current.removing)}

    def load_state(self, state):
        if not (isinstance(state, dict) and set(state) == {"ids", "values", "clock", "removing"}
                and is_int_list(state["ids"]) and is_int_list(state["removing"]) and type(state["clock"]) is int
                and isinstance(state["values"], list) and len(state["values"]) == len(state["ids"])
                and all(type(v) in (int, float) for v in state["values"])):
            raise ValueError(f"{type(self).__name__}: malformed saved state")
        self.current = Keyed(dict(zip(state["ids"], state["values"])), state["clock"], list(state["removing"]))


class LastAccessScorer(KeyedScorer):
    """The last tick at which a row was *accessed*: its score at or above the mean score of the
    non-sink rows (all rows when there are no others; the sinks soak up most attention, so
    the plain mean 1/length would count almost nothing as accessed). A row counts as
    accessed when it is first seen (it was just written, as llama.cpp stamps cells).

    Equal scores are equally accessed: the mean of n equal floats can round a hair above them
    (and Python 3.12's compensated `sum` rounds otherwise than 3.11's), so the threshold gives
    way by a relative 1e-9, far below what a float32 attention score can resolve."""

    def __init__(self, *, sinks: int):
        super().__init__()
        self.sinks = sinks

    def observe(self, value, clock, ids, scores):
        rest = scores[self.sinks:] or scores
        threshold = sum(rest) / len(rest) * (1 - 1e-9)
        for ledger_id, score in zip(ids, scores):
            if score >= threshold or ledger_id not in value:
                value[ledger_id] = clock


class AccumulatedScorer(KeyedScorer):
    """The sum of a row's scores over every tick since it entered. Older rows have had more
    ticks to accumulate; that bias is H2O's own (the recent window protects the youngest)."""

    def observe(self, value, clock, ids, scores):
        for ledger_id, score in zip(ids, scores):
            value[ledger_id] = value.get(ledger_id, 0.0) + score
