"""Maintenance policies (DESIGN §2 Steps 2b–3d, §5): what to take out of the context each tick.

One framework, in the style of kvpress: a policy is a scorer (positronic/policies/scorers.py, one value
per live row, lower = less worth keeping), a unit (rows edited together: 1 row, 2 a pair, n a
chunk), a recent window and a batch, and optionally a repairer (positronic/policies/repairers.py) that
proposes fewer tokens for a unit instead of deleting it. Everything else is shared:

- the one protected-rows rule (`steps.selectable_rows`): the first max(sinks, protect) rows
  and the most recent `window(length)` rows are never touched;
- the one selector (`steps.select_units`): the lowest-valued units first;
- the hard budget: nothing happens below the budget; when the live length has reached it
  (this tick's token needs a row), units are taken until `batch` rows are freed, so the
  live length after the tick's add is at most `budget - batch + 1` and the next `batch - 1`
  ticks only add. A repair frees len(unit) - len(proposal) rows and is only
  taken if that is at least one; otherwise the unit is deleted. If units alone cannot free
  enough (the free rows are fragmented), single rows make up the rest. So after every tick
  live <= budget, whatever the repairer proposes, as long as the validated configuration
  leaves enough free rows (`Policy.check`).
- `prune(view, scores, target)`: the same selection down to `target` rows at once, for a
  prompt longer than the budget (a bulk prune before the first tick).

A policy sees a read-only view of the context (`ContextView`) and this tick's attention
scores, and returns a `PolicyPlan`; Step 3e adds the generated token and Step 4
(`StateManager.apply`) applies everything, whatever the policy.

    brightness  the halo rules (ttl / vote), pairs, repaired by the run's repairer
    streaming   sinks + recent window; the oldest middle rows go (StreamingLLM, --kv-eviction 1)
    scored      the least recently attended rows go (llama.cpp --kv-eviction 2)
    h2o         the rows with the least accumulated attention go (Heavy-Hitter Oracle)
    none        never evict: at capacity stop, or do llama.cpp's context shift
    smartkv     per-layer rows: each layer keeps its own gate-ranked memory (smartkv/policy.py)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from positronic import steps

from ..state.forward import Probes
from .recall import Recall
from .repairers import make_repairer
from .scorers import AccumulatedScorer, BrightnessScorer, LastAccessScorer, RecencyScorer, Scorer

RECENT_MIN = 32  # llama.cpp's recent window is max(RECENT_MIN, length // 4) rows


@dataclass
class PolicyPlan:
    """Actions for Step 3e and, per selected unit, what becomes of it, in words."""

    actions: list[dict] = field(default_factory=list)
    outcomes: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    stop: bool = False  # the policy cannot continue (e.g. `none` at capacity, asked to stop)
    brightness: list[float] | None = None  # Step 2b's new brightness, one per live row (None: unchanged)
    probes: Probes | None = None  # scratch queries for the tick's forward (a repairer's scoring)


def recent_window(length: int) -> int:
    """Rows at the end of a `length`-row cache that llama.cpp never evicts."""
    return max(RECENT_MIN, length // 4)


def pinned_rows(view) -> list[int]:
    """Rows the user pinned: never evicted or repaired."""
    return [] if view.pinned is None else view.pinned.nonzero().flatten().tolist()


def batch_size(budget: int) -> int:
    """Rows below the budget that one llama.cpp eviction batch brings the cache down to
    (llama.cpp frees 32+ cells when `prepare()` fails; budget // 16 is 32 at a budget of 512)."""
    return max(1, budget // 16)


DEFAULT_WINDOW = 32  # BrainConfig.window when neither the user nor the policy chooses one


class Policy:
    """Scorer + unit + window + batch (+ repairer); see the module docstring for the rules."""

    name = "policy"
    unit = 1  # rows per unit
    removed = "evicted"  # the outcome of a deleted unit, in words
    per_layer = False  # True: every layer keeps its own rows (the Brain splits the state's layers)
    reads_keys = False  # True: the plan reads live rows' keys (the Brain passes view(keys=True))

    def __init__(self, lm, config):
        self.config = config
        self.check(config)
        self.scorer: Scorer = self.make_scorer(config)
        self.repairer = None
        self.recall = Recall() if getattr(config, "recall", False) else None

    # --- per policy -------------------------------------------------------------------------

    def make_scorer(self, config) -> Scorer:
        raise NotImplementedError

    @staticmethod
    def default_window(budget: int) -> int:
        """`BrainConfig.window` when none is given."""
        return DEFAULT_WINDOW

    @classmethod
    def window(cls, config, length: int) -> int:
        """Most recent rows never touched, at a live length of `length`."""
        return recent_window(length)

    @classmethod
    def batch(cls, config) -> int:
        """Rows freed at once when the cache is full (llama.cpp's batch + the row this tick's
        token needs: the live length drops to `budget - batch_size` after the add)."""
        return batch_size(config.budget) + 1

    # --- shared -----------------------------------------------------------------------------

    @classmethod
    def check(cls, config) -> None:
        """ValueError unless a full cache leaves at least one batch (+1) rows to take."""
        free = steps.selectable_rows(config.budget, sinks=config.sinks, protect=config.protect,
                                     window=cls.window(config, config.budget))
        need = cls.batch(config)
        if len(free) < need:
            raise ValueError(
                f"policy {cls.name}: budget {config.budget} leaves {len(free)} evictable rows after the protected "
                f"prefix ({max(config.sinks, config.protect)}) and the recent window "
                f"({cls.window(config, config.budget)}); it needs at least {need}")

    def due(self, length: int) -> int:
        """Rows to free this tick, given the live length before this tick's add: none below
        the budget, `batch` at it (more above it, e.g. after a smaller budget was set)."""
        budget = self.config.budget
        return 0 if length < budget else length - budget + self.batch(self.config)

    def plan(self, view, scores: list[float], seconds: dict[str, float]) -> PolicyPlan:
        """This tick's edits; sub-step timings go into `seconds`."""
        return self._plan(view, scores, seconds, lambda length: self.due(length))

    def prune(self, view, scores: list[float], target: int) -> PolicyPlan:
        """Deletes that bring the live length down to `target` rows at once (a bulk prune:
        no repairs, which would free one row per pair at best)."""
        return self._plan(view, scores, {}, lambda length: max(0, length - target), repair=False)

    def _plan(self, view, scores, seconds, need, *, repair: bool = True) -> PolicyPlan:
        clock = time.perf_counter()
        self.scorer.snapshot()
        if len(scores) != len(view):
            raise ValueError(f"{len(scores)} scores for {len(view)} live rows")
        values = self.scorer.values(view, scores)
        seconds["score"] = (now := time.perf_counter()) - clock
        back = self.recall.choose(view) if self.recall is not None and repair else []
        seconds["recall"] = (clock := time.perf_counter()) - now
        count = need(len(values) + len(back))
        actions, outcomes, gone = self.free(view, values, count, repair=repair)
        if back and count:  # rows that could not be freed are not brought back (the budget is hard)
            freed = sum(1 for a in actions if a["action"] == "delete") + sum(2 - len(a["new_token_ids"])
                                                                            for a in actions if a["action"] == "replace_pair")
            back = back[: max(0, freed - need(len(values)))]
        if back:
            actions.append({"action": "restore", "ledger_ids": back, **self.recall.payload(back)})
            outcomes.append(((), f"recalled {len(back)}"))
        if self.recall is not None:
            now = time.perf_counter()
            self.recall.plan(view, gone, back)
            seconds["recall"] += time.perf_counter() - now
        self.scorer.removing([int(view.ledger_ids[row]) for row in gone])
        probes = self.next_probes(view, values, gone, count) if count and repair else None
        seconds["select"] = time.perf_counter() - clock
        return PolicyPlan(actions, outcomes, brightness=values if self.scorer.keeps_brightness else None,
                          probes=probes)

    def select(self, values: list[float], count: int, size: int, *, exclude=()) -> list[tuple[int, ...]]:
        """The lowest `count` units of `size` rows under this policy's protected-rows rule."""
        cfg = self.config
        return steps.select_units(values, count, size=size, sinks=cfg.sinks, protect=cfg.protect,
                                  window=self.window(cfg, len(values)), exclude=exclude)

    def next_probes(self, view, values: list[float], gone: list[int], count: int) -> Probes | None:
        """Probes for the units next in line (the lowest once this tick's are gone), for a
        repairer that scores its candidates in the forward before it uses them."""
        request = getattr(self.repairer, "request", None)
        if request is None:
            return None
        return request(view, self.select(values, count, self.unit, exclude=gone + pinned_rows(view)))

    def undo(self) -> None:
        """The tick of the last plan did not happen (failed, interrupted): the scorer and
        recall forget what that plan observed."""
        self.scorer.undo()
        if self.recall is not None:
            self.recall.discard()

    def _parts(self) -> dict:
        """The parts that carry state from tick to tick."""
        parts = {"scorer": self.scorer}
        if hasattr(self.repairer, "state"):
            parts["repairer"] = self.repairer
        if self.recall is not None:
            parts["recall"] = self.recall
        return parts

    def state(self) -> dict:
        """What the policy carries from tick to tick besides the mirror (a keyed scorer's
        values, a repairer's scores, recall's evicted keys), as plain data for a session."""
        return {name: part.state() for name, part in self._parts().items()}

    def load_state(self, state: dict) -> None:
        """Take a `state()` back; ValueError if it is malformed or does not fit this policy."""
        parts = self._parts()
        if not isinstance(state, dict) or set(state) != set(parts):
            raise ValueError(f"policy {self.name}: saved state has parts "
                             f"{sorted(state) if isinstance(state, dict) else state!r}, expected {sorted(parts)}")
        for name, part in parts.items():
            part.load_state(state[name])

    def receive(self, probe_logprobs: list[float] | None) -> None:
        """The tick of the last plan went through (after `undo` if it failed): the
        log-probabilities of the probes it asked for; recall takes in its evictions."""
        if self.recall is not None:
            self.recall.commit()
        receive = getattr(self.repairer, "receive", None)
        if receive is not None:
            receive(probe_logprobs)

    def free(self, view, values: list[float], need: int, *, repair: bool = True) -> tuple[list[dict], list, list[int]]:
        """Actions that free at least `need` rows: the lowest units, repaired when a proposal
        frees a row (and `repair`), else deleted. If that is not enough, repairs become deletes
        (the latest first), then single rows make up what fragmented units could not.
        Returns the actions, the outcomes and the rows taken out."""
        if need <= 0:
            return [], [], []
        chosen: list[tuple[tuple[int, ...], list[int]]] = []  # (unit, proposal); [] = delete
        freed = 0
        pinned = pinned_rows(view)
        for unit in self.select(values, need, self.unit, exclude=pinned):
            if freed >= need:
                break
            proposal = self.repairer.propose(view, unit) if repair and self.repairer else []
            proposal = proposal if proposal and len(proposal) < len(unit) else []
            chosen.append((unit, proposal))
            freed += len(unit) - len(proposal)
        for index in reversed(range(len(chosen))):
            if freed >= need:
                break
            unit, proposal = chosen[index]
            if proposal:
                chosen[index] = (unit, [])
                freed += len(proposal)
        gone = [row for unit, _ in chosen for row in unit]
        if freed < need:
            rows = self.select(values, need - freed, 1, exclude=gone + pinned)
            chosen += [(unit, []) for unit in rows]
            gone += [row for (row,) in rows]
            freed += len(rows)
        actions, outcomes = [], []
        for unit, proposal in chosen:
            if proposal:
                actions.append({"action": "replace_pair", "original_pos1": unit[0], "original_pos2": unit[-1],
                                "new_token_ids": list(proposal)})
                outcomes.append((unit, "replaced"))
            else:
                actions += [{"action": "delete", "position": row} for row in unit]
                outcomes.append((unit, self.removed))
        if freed < need:
            outcomes.append(((), f"only {freed} of {need} rows could be freed"))
        return actions, outcomes, gone


class BrightnessPolicy(Policy):
    """The halo rules: brightness from attention, then cull (or repair) the dimmest units.
    Unit: `config.unit_rows` (a repairer needs pairs); window: `config.window`; batch:
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
        """`config.repair_batch` rows (1: one row a tick at the budget), fewer when a small
        budget leaves fewer free rows."""
        free = steps.selectable_rows(config.budget, sinks=config.sinks, protect=config.protect,
                                     window=config.window)
        return max(1, min(config.repair_batch, len(free)))


class StreamingPolicy(Policy):
    """StreamingLLM: keep the sinks and the recent window; evict the oldest middle rows."""

    name = "streaming"

    def make_scorer(self, config):
        return RecencyScorer()


class ScoredPolicy(Policy):
    """llama.cpp mode 2: evict the least recently accessed rows first, ties to the older row."""

    name = "scored"

    def make_scorer(self, config):
        return LastAccessScorer(sinks=config.sinks)

    def last_access(self, ledger_id: int) -> int | None:
        value = self.scorer.value.get(ledger_id)
        return None if value is None else int(value)


class H2OPolicy(Policy):
    """Heavy-Hitter Oracle: keep the rows with the most accumulated attention plus the recent
    window; evict the lightest middle rows first, ties to the older row."""

    name = "h2o"

    def make_scorer(self, config):
        return AccumulatedScorer()

    def accumulated(self, ledger_id: int) -> float | None:
        return self.scorer.value.get(ledger_id)


class NoEvictionPolicy:
    """No eviction. When the cache is full (`config.at_capacity`):

    - `stop`: at the tick whose add brings the live length to the budget the plan says stop;
      the Runner (or the evaluator) ends the run after that tick, with the cache exactly full.
    - `shift`: llama.cpp's context shift. When the live length has reached the budget, discard
      the older half of the rows after the protected prefix (`max(sinks, protect)` rows, like
      llama.cpp's n_keep) and the pinned rows, in one batch of deletes. The rows keep their
      RoPE positions.
    """

    name = "none"
    per_layer = reads_keys = False
    default_window = Policy.default_window

    def __init__(self, lm, config):
        self.config = config
        if config.at_capacity not in ("stop", "shift"):
            raise ValueError(f"at_capacity must be 'stop' or 'shift', got {config.at_capacity!r}")

    @classmethod
    def check(cls, config) -> None:
        """`none` never needs free rows; it never evicts, so there is nothing to recall."""
        if getattr(config, "recall", False):
            raise ValueError("recall brings evicted rows back: policy none evicts nothing (choose another policy)")

    def receive(self, probe_logprobs) -> None:
        """`none` never asks for probes."""

    def undo(self) -> None:
        """`none` keeps no per-row state."""

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        if state != {}:
            raise ValueError("policy none keeps no state")

    def plan(self, view, scores: list[float], seconds: dict[str, float]) -> PolicyPlan:
        length, budget = len(scores), self.config.budget
        if self.config.at_capacity == "stop":
            if length + 1 >= budget:
                return PolicyPlan(outcomes=[((), f"cache full ({budget} rows): stopping")], stop=True)
            return PolicyPlan()
        if length < budget:
            return PolicyPlan()
        return self.prune(view, scores, length - (length - self._keep(length)) // 2)

    def prune(self, view, scores: list[float], target: int) -> PolicyPlan:
        """Shift out the oldest rows after the protected prefix, down to `target` rows."""
        length, pinned = len(scores), set(pinned_rows(view))
        keep = self._keep(length)
        rows = [row for row in range(keep, length) if row not in pinned][: max(0, length - target)]
        return PolicyPlan([{"action": "delete", "position": row} for row in rows],
                          [((row,), "shifted out") for row in rows])

    def _keep(self, length: int) -> int:
        return min(max(self.config.sinks, self.config.protect), length)


from ..smartkv.policy import SmartKVPolicy  # noqa: E402  (its own module: per-layer rows, gates)

POLICIES = {policy.name: policy for policy in (BrightnessPolicy, StreamingPolicy, ScoredPolicy, H2OPolicy,
                                                NoEvictionPolicy, SmartKVPolicy)}


def make_policy(name: str, lm, config):
    """The policy `name` for a run of `lm` with `config`."""
    try:
        return POLICIES[name](lm, config)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
