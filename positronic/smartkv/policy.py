"""`--policy smartkv`: the brain keeps different rows in every layer, chosen by the SmartKV gates.

Every layer holds `budget` rows (the same number in each, so the cache stays rectangular):

- the first max(sinks, protect) rows, in every layer for good;
- a **window** of the `window` most recent tokens, in every layer;
- a **long-term memory** of `budget - max(sinks, protect) - window` tokens, its own per layer:
  when a token leaves the window it competes in each layer, by the lifespan that layer's gate
  predicts is still ahead of it (rows.py: `Memories`), with the weakest token of that
  layer's memory; the loser's row is dropped *in that layer*. All layers at once: the
  memories are arrays [layers, memory] and the weakest is one vectorised minimum per tick.

With per-head gates (the shipped ones) every kv head of every layer is such a unit, a *lane*
(lane = layer * kv_heads + head), with its own memory; below, "layer" reads "lane".

The ledger stays one; the state's live map is the union of what the layers hold, and per-layer
rows say which layer holds what (mirror/layer_rows.py). A token retires from the ledger when
the last layer drops it. Each tick is one `drop` action (every layer's rows) plus the add:
once the memory is full, every layer drops exactly one row per tick.

Scores: a token's key in each layer, un-rotated to position 0 (what the gates were trained
on), through that layer's gate (`GateSet.score`), plus log4 of its value norm there
(`value_log_norms`, as SmartKVCache scores). A token is scored only when it is about to
leave the window, together with every other unscored window token, so the gates run once per
layer every `window` ticks on `window` keys (read from the cache through the view).

Pins: a pinned token stays in every lane. It never competes for a memory: when it leaves the
window (or is pinned after it left, when every lane still holds it) every memory gives up a
row for it, and when it is unpinned it competes again.

Recall (`--recall`, recall.py): a token some lanes dropped comes back into the lanes whose
query looks for it, with its own K/V, in place of their weakest memory rows.

Like SmartKVCache (cache.py) for a plain `model.generate`; this is the same layout inside the
brain's tick, mirror, sessions and live view, in any kv_format (int4h reads each lane's keys
at its own rows' positions). Not with a repairer (it replaces pairs of rows every layer holds)
or the ring store (one cursor for every layer).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ..brain.config import AUTO_GATES
from ..policies import PolicyPlan, pinned_rows, register
from ..policies.recall import DEFAULT_SPAN
from .cache import KeyUnrotator, value_log_norms
from .gates import GateFileError, GateSet
from .recall import LaneRecall
from .recent import RecentMemories, lane_shares
from .rows import Memories

MEMORY_RANKS = {"gates": Memories, "recent": RecentMemories}  # --memory-rank: how a lane's memory ranks its rows


def load_gates(spec: str, lm) -> GateSet:
    """The gates of `--gates`: a safetensors path, "" for those shipped for the model, "auto" for
    those or else gates trained on the model's first use (first_use.py)."""
    if spec == AUTO_GATES:
        from .first_use import GateTrainingError, resolve

        try:
            spec = resolve(lm)
        except GateTrainingError as exc:
            raise ValueError(f"smartkv: {exc}") from None
    try:
        gates = GateSet.load(spec) if spec else GateSet.for_model(lm.name)
        gates.check_model(lm.model.config)
        gates.horizon  # noqa: B018  (a broken lifespan horizon is refused here, with the file's other faults)
    except GateFileError as exc:
        raise ValueError(f"smartkv: {exc}") from None
    return gates


@register
class SmartKVPolicy:
    """Per-layer memories of gate-ranked tokens (see the module docstring). A plan's next
    state is (memories, offered, new scores); `commit` makes it current."""

    name = "smartkv"
    per_layer = True  # the Brain gives the state per-layer rows
    reads_keys = True  # the plan reads window tokens' keys (view(keys=True))
    repairer = None
    recall_share = 1.0  # a lane wants a token it lacks at this share of its attention (recall.py)
    recall_hold = 16  # ticks a token taken back cannot be dropped (recall.py)
    # tokens the recall index keeps (the oldest go first): a 4,096-token context past a 1,024-row
    # budget loses nothing (2,048 lost a fact in its first quarter); scoring them is most of recall's
    # cost (SmolLM2 at budget 256: a tick 1.084x with 4,096 indexed against 2,048, bench/recall_cost.py)
    recall_capacity = 4096
    value_norms = True  # scores add log4 of the value norms (a session saved before them resumes without)

    def __init__(self, lm, config):
        self.check(config)
        self.config = config
        self.gates = load_gates(config.gates, lm)
        self.unrotate = KeyUnrotator(lm.inv_freq)
        self.keep = max(config.sinks, config.protect)
        self.size = self.memory_size(config)
        self.horizon = self.gates.horizon
        self.heads = self.gates.heads  # lanes per layer: 1, or the kv heads (per-head gates)
        self.memory = MEMORY_RANKS[config.memory_rank](lm.num_layers * self.heads, self.size, self.horizon)
        self.recall = LaneRecall(self.heads, share=self.recall_share, span=self.recall_span(self.size),
                                 capacity=self.recall_capacity) \
            if config.recall else None
        # recall looks right after each forward, with the query that forward made, and what it
        # brings back is read by that token's forward again (`after_forward`, the `reread`
        # action), not first by the next token's: the token the look was for is predicted with it
        self.reread = bool(getattr(config, "reread", False)) and self.recall is not None
        self.offered = -1  # every ledger id up to this one has left the window (or is a kept row)
        self.pinned_out: frozenset[int] = frozenset()  # pinned tokens out of the window: in every lane, in no memory
        self.scores: dict[int, list[float]] = {}  # ledger id -> its score in each lane
        self._forget_at = 0  # scores kept before the next pass that forgets dropped tokens' scores

    @staticmethod
    def memory_size(config) -> int:
        return config.budget - max(config.sinks, config.protect) - config.window

    @staticmethod
    def recall_span(memory: int) -> int:
        """Tokens one recall brings back around its match: 16, or an eighth of a lane's memory
        when that is fewer. 16 out of a 12.5% budget's 60-row memory gave up a quarter of it
        for one echo of the text (bench/results/history/smartkv.md, 2026-11-27)."""
        return max(1, min(DEFAULT_SPAN, memory // 8))

    @classmethod
    def check(cls, config) -> None:
        """ValueError for settings SmartKV cannot run with."""
        if config.repairer != "none":
            raise ValueError("policy smartkv drops rows per layer: it takes no repairer (--repairer none)")
        if config.window < 1:
            raise ValueError("policy smartkv needs a window of at least 1 row (the newest token)")
        if config.gates and config.gates != AUTO_GATES and not Path(config.gates).is_file():
            raise ValueError(f"policy smartkv: gate file {config.gates} does not exist")
        if cls.memory_size(config) < 1:
            raise ValueError(f"policy smartkv: budget {config.budget} leaves no long-term memory after "
                             f"{max(config.sinks, config.protect)} kept rows and a window of {config.window}")

    @staticmethod
    def default_window(budget: int) -> int:
        """Half the budget: the recent half of the context is what most attention goes to, and
        the memory's other half holds what the gates rank highest (bench/results/history/smartkv.md)."""
        return budget // 2

    @classmethod
    def window(cls, config, length: int) -> int:
        return config.window

    @classmethod
    def batch(cls, config) -> int:
        return 1

    # --- a tick ---------------------------------------------------------------------------

    def plan(self, view, scores, seconds: dict[str, float], *, typed: bool = False):
        """One `drop` action for this tick's token (Step 1's token is added after it)."""
        return self._plan(view, seconds, look=True, typed=typed)

    def prune(self, view, scores, target: int):
        """A prompt longer than the budget: every layer down to `target` rows at once (the
        bulk prune: the older prompt tokens are offered to the memories in position order)."""
        return self._plan(view, {}, look=False)

    def _plan(self, view, seconds: dict[str, float], *, look: bool, typed: bool = False):
        clock = time.perf_counter()
        ids, positions = view.ledger_ids.tolist(), view.positions.tolist()
        window_start = max(self.keep, len(ids) - (self.config.window - 1))  # rows still in the window after the add
        leaving = [row for row in range(self.keep, window_start) if ids[row] > self.offered]
        fresh = self._score(view.rows, [ids[row] for row in leaving], ids, positions)
        scores = self.scores | fresh if fresh else self.scores
        seconds["score"] = (scored := time.perf_counter()) - clock
        memory = self.memory.copy()
        if look and memory.watches and (shares := lane_shares(view, self.heads)) is not None:
            memory.attend(*shares, newer_than=self.offered)  # the attention the newest query paid each lane's rows
        drops: list[list[int]] = [[] for _ in range(memory.layers)]  # ledger ids, per lane

        def dropping(dropped) -> None:
            for lane, gone in enumerate(dropped.tolist()):
                if gone >= 0:
                    drops[lane].append(gone)

        pinned = self._pins(view, memory, scores, dropping)
        for row in leaving:
            ledger_id, position = ids[row], positions[row]
            # ranked at the step whose token pushes this one out of the window (as SmartKVCache does)
            now = position + self.config.window
            if ledger_id in pinned:  # it stays in every lane, outside the memory, which gives up a row
                dropping(memory.shrink(now))
            else:
                dropping(memory.offer(ledger_id, position, scores[ledger_id], now=now))
        lookup = self._recall(view, memory, drops, scores, [ids[row] for row in leaving if ids[row] not in pinned],
                              pinned, look=look and not self.reread, typed=typed)
        seconds["select"] = (now := time.perf_counter()) - scored
        out = frozenset(i for i in pinned if i <= max([self.offered] + [ids[row] for row in leaving]))
        next = (memory, max([self.offered] + [ids[row] for row in leaving]), fresh, lookup, out)
        actions, outcomes = self._actions(view, drops, lookup)
        seconds["recall"] = time.perf_counter() - now if self.recall is not None else 0.0
        return PolicyPlan(actions, outcomes, next=next)

    def after_forward(self, view, *, typed: bool = False) -> PolicyPlan | None:
        """With `reread` and recall, once the tick's forward went through: recall's look for the
        query it made (`view`: the state after it), as a plan whose actions take the tokens back
        (each lane dropping as many of its weakest memory rows) for the Brain to apply with a
        `reread` of the newest row. None: nothing to do (no reread, or the memories are not
        full yet); a plan without actions: the look found nothing, its clock still stands."""
        if not self.reread or self.recall is None or self.memory.count < self.memory.size:
            return None
        memory = self.memory.copy()
        ids = view.ledger_ids.tolist()
        pinned = {ids[row] for row in pinned_rows(view) if row >= self.keep}
        drops: list[list[int]] = [[] for _ in range(memory.layers)]
        lookup = self._recall(view, memory, drops, self.scores, [], pinned, look=True, typed=typed)
        actions, outcomes = self._actions(view, drops, lookup)
        return PolicyPlan(actions, outcomes, next=(memory, self.offered, {}, lookup, self.pinned_out))

    def _actions(self, view, drops: list[list[int]], lookup) -> tuple[list[dict], list]:
        """The drop (ledger ids per lane, `drops`) and restore (`lookup`) actions, and their outcomes."""
        actions, outcomes = [], []
        unit = "layer" if self.heads == 1 else "kv head"
        if any(drops):
            rows = view.rows.lane_rows([sorted(d) for d in drops])
            actions.append({"action": "drop", "rows": rows})
            gone = set.intersection(*(set(d) for d in drops)) if drops else set()
            outcomes.append(((), f"{len(drops[0])} row{'s' * (len(drops[0]) != 1)} dropped per {unit}"
                                 + (f", {len(gone)} token{'s' * (len(gone) != 1)} from every {unit}" if gone else "")))
        if lookup is not None and lookup.back:
            actions.append(self.recall.restore_action(lookup))
            taking = len({lane for lanes in lookup.lanes.values() for lane in lanes})
            outcomes.append(((), f"recalled {len(lookup.back)} into {taking} {unit}{'s' * (taking != 1)}"))
        return actions, outcomes

    def _pins(self, view, memory: Memories, scores: dict, dropping) -> set[int]:
        """The pinned tokens (ledger ids past the kept rows). A token pinned after it left the
        window leaves every memory (each shrinks by one; the state pins only tokens every
        lane holds); an unpinned one that had left it competes again (each grows by one)."""
        ids = view.ledger_ids.tolist()
        pinned = {ids[row] for row in pinned_rows(view) if row >= self.keep}
        for ledger_id in sorted(pinned - self.pinned_out):
            if ledger_id <= self.offered:
                memory.remove(ledger_id)
        where = {ledger_id: row for row, ledger_id in enumerate(ids)}
        for ledger_id in sorted(self.pinned_out - pinned):
            memory.grow()
            if ledger_id in where:
                position = int(view.positions[where[ledger_id]])
                dropping(memory.offer(ledger_id, position, scores[ledger_id], now=int(view.positions[-1]) + 1))
        return pinned

    def _recall(self, view, memory: Memories, drops: list[list[int]], scores: dict, leaving: list[int],
                pinned: set[int], *, look: bool, typed: bool):
        """Recall's part of the tick (None without recall): the lookup, and for each token it
        brings back, the weakest memory row of each lane taking it joins that lane's drops
        (every lane keeps as many rows). The window-leavers' K/V are copied into the lookup."""
        if self.recall is None:
            return None
        lookup = self.recall.idle()
        if look and memory.count == memory.size:  # until the memories are full no lane has dropped anything
            # a token a lane drops this tick is not taken back by it in the same tick
            # (and a pinned token is in every lane)
            width = max(map(len, drops))
            also = np.full((memory.layers, width + len(pinned)), -1, dtype=np.int64)
            for lane, dropped in enumerate(drops):
                also[lane, : len(dropped)] = dropped
            also[:, width:] = sorted(pinned)
            held = np.concatenate([memory.ids[:, : memory.count], also], axis=1)
            # a lane takes back at most half its memory at once
            lookup = self.recall.look_lanes(view, held, max(1, memory.size // 2), typed=typed)
        now = int(view.positions[-1]) + 1
        taking: dict[int, list[int]] = {}  # lane -> the ids it takes back, in lookup order
        for ledger_id in lookup.back:
            for lane in lookup.lanes[ledger_id]:
                taking.setdefault(lane, []).append(ledger_id)
        for lane, back in taking.items():
            drops[lane] += memory.take_back(lane, back, [self.recall.scores[i][lane] for i in back], now,
                                            hold=self.recall_hold)
        self.recall.capture(lookup, view, leaving, scores)
        return lookup

    def _score(self, reader, needed: list[int], ids: list[int], positions: list[int]) -> dict[int, list[float]]:
        """Scores of `needed` tokens not scored yet, and with them of every unscored window token
        (so the gates run in batches): keys and values read from the cache through the view,
        keys un-rotated for the gates, plus log4 of the value norms. Returns {ledger id: score
        per lane}, kept once the tick goes through."""
        if all(ledger_id in self.scores for ledger_id in needed):
            return {}
        window = range(max(self.keep, len(ids) - self.config.window), len(ids))
        wanted = set(needed)
        rows = sorted({row for row, ledger_id in enumerate(ids) if ledger_id in wanted} | set(window))
        rows = [row for row in rows if ids[row] not in self.scores]
        batch = [ids[row] for row in rows]
        keys, values = reader.layer_rows(batch)  # [layers, kv_heads, n, head_dim] each
        at = torch.tensor([positions[row] for row in rows])
        per_layer = [self.gates.score(layer, self.unrotate(keys[layer][None], at)) for layer in range(len(keys))]
        if self.value_norms:
            per_layer = [scores + value_log_norms(values[layer], self.heads) for layer, scores in enumerate(per_layer)]
        table = torch.cat(per_layer, dim=1).tolist()  # [n, lanes]: layer-major, as the state numbers lanes
        return dict(zip(batch, table))

    # --- after the tick -------------------------------------------------------------------

    def commit(self, next, probe_logprobs=None) -> None:
        """The tick of the plan that returned `next` went through: its memories stand."""
        if next is None:
            return
        self.memory, self.offered, fresh, lookup, self.pinned_out = next
        if lookup is not None:
            self.recall.adopt(lookup)
        self.scores.update(fresh)
        if len(self.scores) > self._forget_at:  # forget tokens every lane dropped, now and then
            held = set(self.memory.held_ids())
            self.scores = {i: s for i, s in self.scores.items()
                           if i in held or i > self.offered or i in self.pinned_out}
            self._forget_at = 2 * (len(self.scores) + self.config.window)

    # --- sessions -------------------------------------------------------------------------

    def state(self) -> dict:
        state = {"memory": self.memory.entries(), "offered": self.offered, "value_norms": self.value_norms,
                 "scores": [[ledger_id, list(values)] for ledger_id, values in self.scores.items()]}
        state |= {"pinned": sorted(self.pinned_out)} if self.pinned_out else {}
        state |= self.memory.sums() if self.memory.watches else {}  # the recent-use sums (recent.py)
        return state | ({"recall": self.recall.state()} if self.recall is not None else {})

    def load_state(self, state: dict) -> None:
        layers = self.memory.layers
        try:
            extra = {"recall"} if self.recall is not None else set()
            extra |= {"used", "window_used"} if self.memory.watches else set()  # the recent-use sums
            pinned = state.get("pinned", []) if isinstance(state, dict) else None
            size = self.size - len(pinned) if isinstance(pinned, list) else 0
            ok = (isinstance(state, dict) and set(state) - {"value_norms", "pinned"} == {"memory", "offered", "scores"} | extra
                  and isinstance(pinned, list) and all(type(i) is int for i in pinned) and size >= 1
                  and type(state.get("value_norms", False)) is bool
                  and type(state["offered"]) is int and len(state["memory"]) == layers
                  and len({len(entries) for entries in state["memory"]}) == 1
                  and all(len(entries) <= size and all(len(e) in (3, 4) and all(type(x) is int for x in e[1:])
                                                            for e in entries) for entries in state["memory"])
                  and all(type(i) is int and len(v) == layers for i, v in state["scores"]))
        except TypeError:
            ok = False
        if not ok:
            raise ValueError("policy smartkv: malformed saved state" + (
                " (or saved without recall)" if self.recall is not None and isinstance(state, dict)
                and "recall" not in state else ""))
        memory = type(self.memory).from_entries(state["memory"], size, self.horizon)
        if memory.watches:
            try:
                memory.load_sums(state)
            except ValueError as exc:
                raise ValueError(f"policy smartkv: malformed saved state ({exc})") from None
        if self.recall is not None:
            self.recall.load_state(state["recall"])
        self.memory = memory
        self.pinned_out = frozenset(pinned)
        self.offered = state["offered"]
        self.scores = {i: [float(x) for x in v] for i, v in state["scores"]}
        self.value_norms = state.get("value_norms", False)  # saved before value norms: scored without
