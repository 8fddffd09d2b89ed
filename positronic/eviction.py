"""llama.cpp-style KV eviction policies (DESIGN §5, seed 003), selected with `--policy`.

    streaming  sinks + recent window; evict the oldest middle rows (StreamingLLM, --kv-eviction 1)
    scored     evict the least recently attended middle rows first (--kv-eviction 2)
    h2o        evict the middle rows with the least accumulated attention (Heavy-Hitter Oracle)
    none       never evict; at capacity stop the run, or do llama.cpp's context shift

Rules shared by the three evicting policies (seed 003):

- never evicted: the first `max(sinks, protect)` rows (attention sinks and the protected
  prefix both count from row 0) and the most recent `max(32, length // 4)` rows, where
  `length` is the live length when the policy plans. `config.window` is not used here.
- eviction happens in batches, only when the cache is full: when the live length has reached
  the budget (so this tick's token needs a free row), the policy evicts enough rows that the
  live length after this tick's add is `budget - batch`, with `batch = max(1, budget // 16)`
  (llama.cpp frees 32+ cells when `prepare()` fails; budget // 16 is 32 at a budget of 512).
  The live length therefore never exceeds the budget and moves in a saw-tooth between
  `budget - batch` and `budget`.
- if fewer rows are evictable than needed, all evictable rows go (the outcome says so);
  constructing a policy whose budget leaves fewer than `batch + 1` evictable rows raises
  ValueError.

Per-row state (last access tick, accumulated attention) is keyed by ledger id, so it
survives every splice. An evicted row's state is dropped at the next plan, once the row is
gone: a tick that fails changes nothing, and its rows keep their state (the failed tick's
own observation still counts). Every policy edits only through `delete` actions, applied by
`StateManager.apply` like any other tick's edits.

`scores` (one per live row) are the newest token's attention over every live row (mean over
heads and the configured layers), so they sum to ~1 and the newest row is the last one.
"""

from __future__ import annotations

import time

from .policy_plan import PolicyPlan

RECENT_MIN = 32  # the recent window is max(RECENT_MIN, length // 4) rows


def recent_window(length: int) -> int:
    """Rows at the end of a `length`-row cache that are never evicted (llama.cpp's rule)."""
    return max(RECENT_MIN, length // 4)


def batch_size(budget: int) -> int:
    """Rows below the budget that one eviction batch brings the cache down to."""
    return max(1, budget // 16)


def evictable_rows(length: int, *, sinks: int, protect: int) -> range:
    """Rows that may be evicted: after the protected prefix, before the recent window."""
    start = min(max(sinks, protect), length)
    return range(start, max(start, length - recent_window(length)))


def _plan(actions=(), outcomes=(), stop=False) -> PolicyPlan:
    return PolicyPlan(list(actions), list(outcomes), stop)


class EvictionPolicy:
    """Base of the evicting policies: when and how many; subclasses choose which rows."""

    name = "eviction"

    def __init__(self, lm, config):
        self.config = config
        self.budget = config.budget
        self.batch = batch_size(config.budget)
        self.clock = 0  # plan() calls so far (one per tick)
        self.evicting: list[int] = []  # ledger ids of the rows the last plan evicted
        self.check(config)

    @classmethod
    def check(cls, config) -> None:
        """Raise ValueError unless a full cache leaves at least one batch (+1) evictable rows."""
        room = len(evictable_rows(config.budget, sinks=config.sinks, protect=config.protect))
        need = batch_size(config.budget) + 1
        if room < need:
            raise ValueError(
                f"policy {cls.name}: budget {config.budget} leaves {room} evictable rows after the protected "
                f"prefix ({max(config.sinks, config.protect)}) and the recent window ({recent_window(config.budget)}); "
                f"it needs at least {need}")

    def due(self, length: int) -> int:
        """Rows to evict this tick, given the live length before this tick's add."""
        if length < self.budget:
            return 0
        return length + 1 - (self.budget - self.batch)

    def plan(self, view, scores: list[float], seconds: dict[str, float]) -> PolicyPlan:
        clock = time.perf_counter()
        self.clock += 1
        length = len(scores)
        if length != len(view):
            raise ValueError(f"{length} scores for {len(view)} live rows")
        ids = view.ledger_ids.tolist()
        if self.evicting:
            # Forget the rows the last plan evicted only now that they are gone: if that tick
            # failed (Step 4 then changes nothing), they are still live and keep their state.
            live = set(ids)
            self.forget(ledger_id for ledger_id in self.evicting if ledger_id not in live)
            self.evicting = []
        self.observe(ids, scores)
        count = self.due(length)
        actions, outcomes = [], []
        if count:
            candidates = evictable_rows(length, sinks=self.config.sinks, protect=self.config.protect)
            rows = sorted(self.select(ids, scores, candidates, min(count, len(candidates))))
            actions = [{"action": "delete", "position": row} for row in rows]
            outcomes = [((row,), "evicted") for row in rows]
            if len(rows) < count:
                outcomes.append(((), f"only {len(rows)} of {count} rows evictable"))
            self.evicting = [ids[row] for row in rows]
        seconds["evict"] = time.perf_counter() - clock
        return _plan(actions, outcomes)

    # --- per subclass ---------------------------------------------------------------------

    def observe(self, ids: list[int], scores: list[float]) -> None:
        """Update per-row state from this tick's scores (ids: ledger id per row)."""

    def select(self, ids: list[int], scores: list[float], candidates: range, count: int) -> list[int]:
        raise NotImplementedError

    def forget(self, ledger_ids) -> None:
        """Drop the state of rows that were evicted."""


class StreamingPolicy(EvictionPolicy):
    """StreamingLLM: keep the sinks and the recent window; evict the oldest middle rows."""

    name = "streaming"

    def select(self, ids, scores, candidates, count):
        return list(candidates[:count])


class _KeyedPolicy(EvictionPolicy):
    """A policy with one number per row, keyed by ledger id; evicts the lowest first,
    ties to the older (lower) row."""

    def __init__(self, lm, config):
        super().__init__(lm, config)
        self.value: dict[int, float] = {}

    def select(self, ids, scores, candidates, count):
        value = self.value
        return sorted(candidates, key=lambda row: (value[ids[row]], row))[:count]

    def forget(self, ledger_ids) -> None:
        for ledger_id in ledger_ids:
            self.value.pop(ledger_id, None)

    def _prune(self, ids: list[int]) -> None:
        """Drop entries of rows that left the cache some other way (never grows unbounded)."""
        if len(self.value) > 2 * len(ids) + 64:
            live = set(ids)
            self.value = {k: v for k, v in self.value.items() if k in live}


class ScoredPolicy(_KeyedPolicy):
    """llama.cpp mode 2: evict the least recently accessed rows first.

    A row is *accessed* at a tick when its score is above the mean score of the non-sink rows
    (the rows after the first `sinks`; all rows when there are no others). The sinks soak up
    most of the attention, so the plain mean 1/length would count almost nothing as accessed.
    A row counts as accessed at the tick it is first seen (it was just written, as llama.cpp
    stamps cells in `apply_ubatch`). Eviction order: lowest last-access tick first, ties to
    the older row.
    """

    name = "scored"

    def observe(self, ids, scores):
        rest = scores[self.config.sinks:] or scores
        threshold = sum(rest) / len(rest)
        value, now = self.value, self.clock
        for ledger_id, score in zip(ids, scores):
            if score > threshold or ledger_id not in value:
                value[ledger_id] = now
        self._prune(ids)

    def last_access(self, ledger_id: int) -> int | None:
        value = self.value.get(ledger_id)
        return None if value is None else int(value)


class H2OPolicy(_KeyedPolicy):
    """Heavy-Hitter Oracle: keep the rows with the most accumulated attention (the sum of their
    scores over every tick since they entered) plus the recent window; evict the lightest
    middle rows first, ties to the older row. Older rows have had more ticks to accumulate;
    that bias is H2O's own (the recent window protects the youngest)."""

    name = "h2o"

    def observe(self, ids, scores):
        value = self.value
        for ledger_id, score in zip(ids, scores):
            value[ledger_id] = value.get(ledger_id, 0.0) + score
        self._prune(ids)

    def accumulated(self, ledger_id: int) -> float | None:
        return self.value.get(ledger_id)


class NoEvictionPolicy:
    """No eviction. When the cache is full (`config.at_capacity`):

    - `stop`: at the tick whose add brings the live length to the budget the plan says stop;
      the Runner (or the evaluator) ends the run after that tick, with the cache exactly full.
    - `shift`: llama.cpp's context shift. When the live length has reached the budget, discard
      the older half of the rows after the protected prefix (`max(sinks, protect)` rows, like
      llama.cpp's n_keep), in one batch of deletes. The rows keep their RoPE positions.
    """

    name = "none"

    def __init__(self, lm, config):
        self.config = config
        if config.at_capacity not in ("stop", "shift"):
            raise ValueError(f"at_capacity must be 'stop' or 'shift', got {config.at_capacity!r}")

    def plan(self, view, scores: list[float], seconds: dict[str, float]) -> PolicyPlan:
        length, budget = len(scores), self.config.budget
        if self.config.at_capacity == "stop":
            if length + 1 >= budget:
                return _plan(outcomes=[((), f"cache full ({budget} rows): stopping")], stop=True)
            return _plan()
        if length < budget:
            return _plan()
        keep = min(max(self.config.sinks, self.config.protect), length)
        rows = range(keep, keep + (length - keep) // 2)
        return _plan([{"action": "delete", "position": row} for row in rows],
                     [((row,), "shifted out") for row in rows])


EVICTION_POLICIES = {
    "streaming": StreamingPolicy,
    "scored": ScoredPolicy,
    "h2o": H2OPolicy,
    "none": NoEvictionPolicy,
}
