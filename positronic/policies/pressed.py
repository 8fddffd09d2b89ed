"""Any press as a policy: a press written in one file (positronic/presses/) ticks one sequence
in a `Brain` too, so `run --policy NAME`, `serve --policy NAME`, `eval` and saved sessions
take it with no code of their own.

`PressPolicy` runs the press at S = 1 on the tick's view: `Rows` of the live rows (shares from
Step 2a's scores, positions, pins, token ids, a reader of K/V for a press that reads keys),
its per-row state kept beside the ledger ids it belongs to (rows the tick deleted fall away,
a new row starts at the press's fill), its per-sequence state and its clock. The selection
is the press's own, so a sequence makes the same tokens ticking alone as in an engine's
rounds, and it carries its state into an engine and back (`carried`, `restored`).

A press that keeps lanes apart (smartkv), brings rows back (recall) or keeps tensors in its
slot needs a policy of its own: making its PressPolicy is refused by name.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, ClassVar

import torch

from .base import DEFAULT_WINDOW, PolicyPlan
from .recall import raw

if TYPE_CHECKING:  # presses/__init__ imports this module to register a press's policy
    from ..presses.base import Press, Rows

class PressPolicy:
    """The policy of one press (`press_class`), one sequence at a time; see the module docstring."""

    name: ClassVar[str]
    press_class: ClassVar[type[Press]]
    per_layer = False
    removed = "evicted"
    recall = repairer = None

    def __init__(self, lm, config):
        self.config = config
        self.press = self.make_press(config)
        self.press.bind(lm)
        press = self.press
        if press.lanes != 1 or press.slot_state or press.reads_lane_peaks or press.reads_query:
            raise ValueError(f"press {press.name!r} keeps lanes, slot tensors or the newest query: it needs a policy "
                             "of its own (positronic/policies/) to tick alone")
        self.reads_keys = self.press.reads_keys
        self.ids = torch.empty(0, dtype=torch.long)  # ledger ids of the rows `rows` describe
        self.rows: dict[str, torch.Tensor] = {name: torch.empty(0, dtype=dtype)
                                              for name, (dtype, _) in self.press.row_state.items()}
        self.sequence: dict[str, torch.Tensor] = self.press.sequence_state()
        self.clock = 0  # ticks scored

    # --- what BrainConfig and the CLI ask of a policy class ------------------------------------

    @classmethod
    def make_press(cls, config) -> Press:
        """The press with the settings `config` gives it: BrainConfig's fields by name, then its
        `policy_options` (the press's own settings). ValueError naming a bad one."""
        try:
            return cls.press_class(config)
        except ValueError as exc:
            raise ValueError(f"policy {cls.name}: {exc}") from None

    @classmethod
    def check(cls, config) -> None:
        cls.make_press(config)  # the press's own checks: its settings, room for a batch

    @staticmethod
    def default_window(budget: int) -> int:
        return DEFAULT_WINDOW

    @classmethod
    def window(cls, config, length: int) -> int:
        return cls.make_press(config).window_at(length)

    @classmethod
    def batch(cls, config) -> int:
        return cls.make_press(config).batch()

    # --- a tick ------------------------------------------------------------------------------------

    def plan(self, view, scores: list[float], seconds: dict[str, float], *, typed: bool = False) -> PolicyPlan:
        clock = time.perf_counter()
        rows, state = self._inputs(view, scores)
        plan = self.press.plan(rows, state, torch.tensor([self.clock]))
        seconds["select"] = time.perf_counter() - clock
        return self._plan(view, plan, self.clock + 1)

    def prune(self, view, scores: list[float], target: int) -> PolicyPlan:
        """Delete down to `target` rows at once, the recent window the pruned context's."""
        rows, state = self._inputs(view, scores)
        need = (rows.length - target).clamp(min=0)
        plan = self.press.plan(rows, state, torch.tensor([self.clock]), need, kept=rows.length.clamp(max=target + 1))
        return self._plan(view, plan, self.clock)

    def commit(self, next, probe_logprobs=None) -> None:
        if next is not None:
            self.ids, self.rows, self.sequence, self.clock = next

    def _inputs(self, view, scores: list[float]) -> tuple[Rows, dict[str, torch.Tensor]]:
        """The press's Rows and state for the view's rows: S = 1, N = the live rows."""
        from ..presses.base import Rows

        count = len(view)
        if len(scores) != count:
            raise ValueError(f"{len(scores)} scores for {count} live rows")
        reader = view.rows

        def read(members: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = reader(rows.tolist())  # [layers, kv_heads, n, head_dim]
            return keys.permute(2, 0, 1, 3), values.permute(2, 0, 1, 3)

        pinned = view.pinned if view.pinned is not None else torch.zeros(count, dtype=torch.bool)
        rows = Rows(length=torch.tensor([count]), positions=view.positions[None].long(),
                    shares=torch.tensor(scores, dtype=torch.float32)[None], pinned=pinned[None],
                    read=read if self.press.reads_keys else None, token_ids=view.token_ids[None].long())
        state = {name: values[None] for name, values in self.aligned(view.ledger_ids).items()}
        return rows, state | {name: value[None] for name, value in self.sequence.items()}

    def aligned(self, ledger_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-row state of the rows `ledger_ids` [n]: each row's kept value, a row not
        seen before (the newest) at the press's fill."""
        out = {}
        order = torch.argsort(self.ids)
        known = self.ids[order]
        at = torch.searchsorted(known, ledger_ids).clamp(max=max(len(known) - 1, 0))
        found = (known[at] == ledger_ids) if len(known) else torch.zeros(len(ledger_ids), dtype=torch.bool)
        for name, (dtype, fill) in self.press.row_state.items():
            values = torch.full((len(ledger_ids),), fill, dtype=dtype)
            if len(known):
                values[found] = self.rows[name][order[at[found]]]
            out[name] = values
        return out

    def _plan(self, view, plan, clock: int) -> PolicyPlan:
        gone = plan.deleted[0].nonzero().flatten().tolist()[::-1]  # highest first
        rows = {name: plan.next[name][0] for name in self.press.row_state}
        sequence = {name: plan.next[name][0] for name in self.press.sequence_state()}
        outcomes = [((row,), self.removed) for row in gone[::-1]]
        if bool(plan.stop[0]):
            outcomes.append(((), f"the press stops ({self.config.budget} rows)"))
        return PolicyPlan([{"action": "delete", "position": row} for row in gone], outcomes, stop=bool(plan.stop[0]),
                          next=(view.ledger_ids.clone(), rows, sequence, clock))

    # --- into an engine and back, and a session's state ---------------------------------------------

    def carried(self, ledger_ids: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        """Per-row state of the rows `ledger_ids` (a joining sequence's live rows), the
        per-sequence state and the clock, as an engine keeps them."""
        rows = self.aligned(torch.tensor(ledger_ids, dtype=torch.long))
        return rows, {name: value.clone() for name, value in self.sequence.items()}, self.clock

    def restored(self, ledger_ids: list[int], rows: dict[str, torch.Tensor], sequence: dict[str, torch.Tensor],
                 clock: int) -> None:
        """`carried` backwards: the state an engine kept for the rows `ledger_ids`."""
        self.ids = torch.tensor(ledger_ids, dtype=torch.long)
        self.rows = {name: rows[name].cpu().clone() for name in self.press.row_state}
        self.sequence = {name: value.cpu().clone() for name, value in sequence.items()}
        self.clock = clock

    def state(self) -> dict:
        return {"ids": self.ids.tolist(), "clock": self.clock,
                "rows": {name: _plain(value) for name, value in self.rows.items()},
                "sequence": {name: _plain(value) for name, value in self.sequence.items()}}

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"ids", "clock", "rows", "sequence"}:
            raise ValueError(f"policy {self.name}: saved state needs ids, clock, rows and sequence")
        ids, clock = state["ids"], state["clock"]
        if not (isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)) or type(clock) is not int:
            raise ValueError(f"policy {self.name}: saved ids must be ledger ids and clock an int")
        rows = _tensors(self.name, state["rows"], {n: d for n, (d, _) in self.press.row_state.items()})
        if any(tuple(value.shape) != (len(ids),) for value in rows.values()):
            raise ValueError(f"policy {self.name}: saved per-row state must hold one value per saved id ({len(ids)})")
        fresh = self.press.sequence_state()
        sequence = _tensors(self.name, state["sequence"], {n: v.dtype for n, v in fresh.items()})
        if any(value.shape != fresh[name].shape for name, value in sequence.items()):
            raise ValueError(f"policy {self.name}: saved per-sequence state does not fit the press")
        self.ids, self.rows, self.sequence, self.clock = torch.tensor(ids, dtype=torch.long), rows, sequence, clock


def _plain(tensor: torch.Tensor) -> dict:
    """A tensor as a session's plain data: dtype, shape and its bytes."""
    return {"dtype": str(tensor.dtype), "shape": list(tensor.shape), "data": raw(tensor)}


def _tensors(policy: str, saved, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """`_plain` backwards for every name in `dtypes`; ValueError naming what does not fit."""
    if not isinstance(saved, dict) or set(saved) != set(dtypes):
        raise ValueError(f"policy {policy}: saved state names {sorted(saved) if isinstance(saved, dict) else saved!r},"
                         f" expected {sorted(dtypes)}")
    out = {}
    for name, dtype in dtypes.items():
        item = saved[name]
        ok = isinstance(item, dict) and set(item) == {"dtype", "shape", "data"} and item["dtype"] == str(dtype) \
            and isinstance(item["data"], bytes) and isinstance(item["shape"], list) \
            and all(type(n) is int and n >= 0 for n in item["shape"])
        if not ok or len(item["data"]) != math.prod(item["shape"]) * dtype.itemsize:
            raise ValueError(f"policy {policy}: saved {name!r} is not a {dtype} tensor of its shape")
        out[name] = torch.frombuffer(bytearray(item["data"]), dtype=torch.uint8).view(dtype).reshape(item["shape"]) \
            if item["data"] else torch.empty(item["shape"], dtype=dtype)
    return out


def policy_of(press_class: type[Press]) -> type[PressPolicy]:
    """The policy class of `press_class` (registered under the press's name by `presses.register`;
    a press that keeps lanes is refused when its policy is made, once `bind` has told)."""
    return type(f"{press_class.__name__}Policy", (PressPolicy,), {"name": press_class.name, "press_class": press_class,
                                                                  "__doc__": press_class.__doc__})
