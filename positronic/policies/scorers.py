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

from positronic import steps

from ..util import is_int_list


class Scorer:
    """Base: `values(view, scores)` once per tick; `removing(ledger_ids)` tells it which rows
    the tick's plan takes out (a scorer with per-row state forgets them once they are gone)."""

    keeps_brightness = False  # True: the values are stored as the rows' new brightness

    def values(self, view, scores: list[float]) -> list[float]:
        raise NotImplementedError

    def removing(self, ledger_ids: list[int]) -> None:
        """The plan of this tick takes these rows out (if the tick goes through)."""

    def snapshot(self) -> None:
        """A tick's plan starts: remember the state, for `undo`."""

    def undo(self) -> None:
        """The tick since the last `snapshot` did not happen (it failed or was interrupted):
        forget what it observed, so that running it again does not count it twice."""

    def state(self) -> dict:
        """The per-row state as plain data (msgpack-able), for a session checkpoint."""
        return {}

    def load_state(self, state: dict) -> None:
        """Take a `state()` back; ValueError naming what is malformed (nothing changes then)."""
        if state != {}:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state) if isinstance(state, dict) else state!r}")


class BrightnessScorer(Scorer):
    """Brightness from attention with a rule of `steps.RULES`; new rows start at the rule's start."""

    keeps_brightness = True

    def __init__(self, config):
        self.rule = steps.RULES[config.brightness]
        self.options = {option: getattr(config, setting) for option, setting in self.rule.settings}

    def values(self, view, scores):
        return self.rule.update(view.brightness.tolist(), scores, **self.options)


class RecencyScorer(Scorer):
    """A row's RoPE position: the oldest middle rows go first."""

    def values(self, view, scores):
        return [float(p) for p in view.positions.tolist()]


class KeyedScorer(Scorer):
    """A number per row, keyed by ledger id. Rows a plan removes are forgotten at the next
    call, once they are really gone: a tick that failed changed nothing, and its rows keep
    what the scorer knew before it (`undo` takes back the failed tick's observation)."""

    def __init__(self):
        self.value: dict[int, float] = {}
        self.clock = 0  # calls so far (one per tick)
        self._removing: list[int] = []
        self._before: tuple[dict[int, float], int, list[int]] | None = None

    def values(self, view, scores):
        ids = view.ledger_ids.tolist()
        if len(scores) != len(ids):
            raise ValueError(f"{len(scores)} scores for {len(ids)} live rows")
        self.clock += 1
        if self._removing:
            live = set(ids)
            for ledger_id in self._removing:
                if ledger_id not in live:
                    self.value.pop(ledger_id, None)
            self._removing = []
        self.observe(ids, scores)
        if len(self.value) > 2 * len(ids) + 64:  # rows that left some other way: never grows unbounded
            live = set(ids)
            self.value = {k: v for k, v in self.value.items() if k in live}
        return [self.value[i] for i in ids]

    def removing(self, ledger_ids):
        self._removing = list(ledger_ids)

    def snapshot(self):
        self._before = (dict(self.value), self.clock, list(self._removing))  # O(rows), small next to a forward

    def undo(self):
        if self._before is not None:
            self.value, self.clock, self._removing = self._before
            self._before = None

    def observe(self, ids: list[int], scores: list[float]) -> None:
        raise NotImplementedError

    def state(self):
        return {"ids": list(self.value), "values": list(self.value.values()), "clock": self.clock,
                "removing": list(self._removing)}

    def load_state(self, state):
        if not (isinstance(state, dict) and set(state) == {"ids", "values", "clock", "removing"}
                and is_int_list(state["ids"]) and is_int_list(state["removing"]) and type(state["clock"]) is int
                and isinstance(state["values"], list) and len(state["values"]) == len(state["ids"])
                and all(type(v) in (int, float) for v in state["values"])):
            raise ValueError(f"{type(self).__name__}: malformed saved state")
        self.value = dict(zip(state["ids"], state["values"]))
        self.clock, self._removing, self._before = state["clock"], list(state["removing"]), None


class LastAccessScorer(KeyedScorer):
    """The last tick at which a row was *accessed*: its score above the mean score of the
    non-sink rows (all rows when there are no others; the sinks soak up most attention, so
    the plain mean 1/length would count almost nothing as accessed). A row counts as
    accessed when it is first seen (it was just written, as llama.cpp stamps cells)."""

    def __init__(self, *, sinks: int):
        super().__init__()
        self.sinks = sinks

    def observe(self, ids, scores):
        rest = scores[self.sinks:] or scores
        threshold = sum(rest) / len(rest)
        value, now = self.value, self.clock
        for ledger_id, score in zip(ids, scores):
            if score > threshold or ledger_id not in value:
                value[ledger_id] = now


class AccumulatedScorer(KeyedScorer):
    """The sum of a row's scores over every tick since it entered. Older rows have had more
    ticks to accumulate; that bias is H2O's own (the recent window protects the youngest)."""

    def observe(self, ids, scores):
        value = self.value
        for ledger_id, score in zip(ids, scores):
            value[ledger_id] = value.get(ledger_id, 0.0) + score
