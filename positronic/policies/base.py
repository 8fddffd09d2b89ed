"""The policy framework (DESIGN §2 Steps 2b–3d, §5): what to take out of the context each tick.

One framework, in the style of kvpress: a policy is a scorer (scorers.py, one value per live
row, lower = less worth keeping), a unit (rows edited together: 1 row, 2 a pair, n a chunk),
a recent window and a batch, and optionally a repairer (repairers.py) that proposes fewer
tokens for a unit instead of deleting it, and recall (recall.py), a part that brings evicted
rows back. Everything else is shared, here:

- the one protected-rows rule (`steps.selectable_rows`): the first max(sinks, protect) rows,
  the most recent `window(length)` rows and the pinned rows are never touched;
- the one selector (`steps.select_units`): the lowest-valued units first;
- the hard budget (`due`): nothing happens below the budget; when the live length has reached
  it (this tick's token needs a row), units are taken until `batch` rows are freed, so the
  live length after the tick's add is at most `budget - batch + 1` and the next `batch - 1`
  ticks only add. A repair frees len(unit) - len(proposal) rows and is only taken if that is
  at least one; otherwise the unit is deleted. If units alone cannot free enough (the free
  rows are fragmented), single rows make up the rest (`free`). So after every tick
  live <= budget, whatever the repairer proposes, as long as the validated configuration
  leaves enough free rows (`Policy.check`).
- `prune(view, scores, target)`: the same selection down to `target` rows at once, for a
  prompt longer than the budget (a bulk prune before the first tick).

The protocol: `plan(view, scores, seconds)` reads a read-only view of the context and this
tick's attention scores and returns a `PolicyPlan`: the actions *and* the policy's next state
(`PolicyPlan.next`). Nothing the policy holds changes while it plans. Step 3e adds the token,
Step 4 (`StateManager.apply`) applies everything, and only when that went through does the
Brain hand the next state back (`commit`, with the probes' log-probabilities): a tick that
failed or was interrupted leaves the policy exactly as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from positronic import steps

from ..state.forward import Probes
from .recall import NO_RECALL, NoRecall, Recall
from .scorers import Scorer

RECENT_MIN = 32  # llama.cpp's recent window is max(RECENT_MIN, length // 4) rows
DEFAULT_WINDOW = 32  # BrainConfig.window when neither the user nor the policy chooses one


@dataclass
class PolicyPlan:
    """Actions for Step 3e and, per selected unit, what becomes of it, in words; and the
    policy's state once the tick has gone through (`Policy.commit`; None: unchanged)."""

    actions: list[dict] = field(default_factory=list)
    outcomes: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    stop: bool = False  # the policy cannot continue (e.g. `none` at capacity, asked to stop)
    brightness: list[float] | None = None  # Step 2b's new brightness, one per live row (None: unchanged)
    probes: Probes | None = None  # scratch queries for the tick's forward (a repairer's scoring)
    next: Any = None  # the policy's next state: current only once the tick commits


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


def freed_rows(actions: list[dict]) -> int:
    """Rows the deletes and repairs of `actions` take out of the context."""
    return sum(1 if a["action"] == "delete" else 2 - len(a["new_token_ids"]) for a in actions
               if a["action"] in ("delete", "replace_pair"))


class Policy:
    """Scorer + unit + window + batch (+ repairer, + recall); see the module docstring."""

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
        self.recall: Recall | None = Recall() if getattr(config, "recall", False) else None

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
        """Rows freed at once when the cache is full, so the policy edits once every `batch`
        ticks: `evict_every` if set, else llama.cpp's batch + the row this tick's token needs
        (the live length drops to `budget - batch_size` after the add)."""
        return config.evict_every or batch_size(config.budget) + 1

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

    def plan(self, view, scores: list[float], seconds: dict[str, float], *, typed: bool = False) -> PolicyPlan:
        """This tick's edits and next state; sub-step timings go into `seconds`. `typed`: this
        tick adds a typed token (recall looks at the next tick's query whatever its schedule)."""
        return self._plan(view, scores, seconds, self.due, typed=typed)

    def prune(self, view, scores: list[float], target: int) -> PolicyPlan:
        """Deletes that bring the live length down to `target` rows at once (a bulk prune:
        no repairs, which would free one row per pair at best, and no recall). The recent window
        is the pruned context's (`target` rows and the one added with them), not the long
        prompt's: a window of a quarter of 4x the budget would leave the budget no room."""
        return self._plan(view, scores, {}, lambda length: max(0, length - target), repair=False, kept=target + 1)

    def _plan(self, view, scores, seconds, need, *, repair: bool = True, typed: bool = False,
              kept: int | None = None) -> PolicyPlan:
        clock = time.perf_counter()
        if len(scores) != len(view):
            raise ValueError(f"{len(scores)} scores for {len(view)} live rows")
        values, scored = self.scorer.plan(view, scores)
        seconds["score"] = (now := time.perf_counter()) - clock
        recall = self.recall_part
        lookup = recall.look(view, typed=typed) if repair else recall.idle()
        clock = time.perf_counter()
        recalling = self.recall is not None  # the stand-in's calls are not recall's time
        seconds["recall"] = clock - now if recalling else 0.0
        count = need(len(values) + len(lookup.back))
        actions, outcomes, gone = self.free(view, values, count, repair=repair, kept=kept)
        if count:  # rows that could not be freed are not brought back (the budget is hard)
            lookup.fit(freed_rows(actions) - need(len(values)))
        now = time.perf_counter()
        recall.settle(lookup, view, gone, actions, outcomes)
        if recalling:
            seconds["recall"] += time.perf_counter() - now
        self.scorer.removing(scored, [int(view.ledger_ids[row]) for row in gone])
        probes, asked = self.next_probes(view, values, gone, count) if count and repair else (None, None)
        seconds["select"] = time.perf_counter() - clock
        return PolicyPlan(actions, outcomes, brightness=values if self.scorer.keeps_brightness else None,
                          probes=probes, next={"scorer": scored, "recall": lookup, "repairer": asked})

    def commit(self, next: dict | None, probe_logprobs: list[float] | None = None) -> None:
        """The tick of the plan that returned `next` went through: its state becomes current;
        `probe_logprobs` are the log-probabilities of the probes the plan asked for."""
        if next is None:
            return
        self.scorer.adopt(next["scorer"])
        self.recall_part.adopt(next["recall"])
        if next["repairer"] is not None:
            self.repairer.adopt(next["repairer"], probe_logprobs)

    @property
    def recall_part(self) -> Recall | NoRecall:
        """The recall the policy consults each tick: its `recall`, or a stand-in that recalls nothing."""
        return NO_RECALL if self.recall is None else self.recall

    def select(self, values: list[float], count: int, size: int, *, exclude=(),
               kept: int | None = None) -> list[tuple[int, ...]]:
        """The lowest `count` units of `size` rows under this policy's protected-rows rule, its
        recent window that of a context of `kept` rows (default: the live length)."""
        cfg = self.config
        return steps.select_units(values, count, size=size, sinks=cfg.sinks, protect=cfg.protect,
                                  window=self.window(cfg, kept or len(values)), exclude=exclude)

    def next_probes(self, view, values: list[float], gone: list[int], count: int) -> tuple[Probes | None, Any]:
        """Probes for the units next in line (the lowest once this tick's are gone), for a
        repairer that scores its candidates in the forward before it uses them, and what the
        repairer needs to read their answers (None: it asks for none)."""
        request = getattr(self.repairer, "request", None)
        if request is None:
            return None, None
        return request(view, self.select(values, count, self.unit, exclude=gone + pinned_rows(view)))

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

    def free(self, view, values: list[float], need: int, *, repair: bool = True,
             kept: int | None = None) -> tuple[list[dict], list, list[int]]:
        """Actions that free at least `need` rows: the lowest units, repaired when a proposal
        frees a row (and `repair`), else deleted. If that is not enough, repairs become deletes
        (the latest first), then single rows make up what fragmented units could not.
        Returns the actions, the outcomes and the rows taken out."""
        if need <= 0:
            return [], [], []
        chosen: list[tuple[tuple[int, ...], list[int]]] = []  # (unit, proposal); [] = delete
        freed = 0
        pinned = pinned_rows(view)
        for unit in self.select(values, need, self.unit, exclude=pinned, kept=kept):
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
            rows = self.select(values, need - freed, 1, exclude=gone + pinned, kept=kept)
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
