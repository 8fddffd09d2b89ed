"""Core v4's state: many sequences in one set of tensors, edited a round at a time.

`SlotState` is the one writer of a `SlotKV` (positronic/kv/slots.py) and of the sequences'
mirrors. Sequence s lives in slot s (the first `active` slots are in use); its rows are
rows `0..length[s]-1` of the slot, and next to them the state keeps, as device tensors:

    length      [slots] int64             live rows
    positions   [slots, capacity] int64   each row's RoPE position
    row_state   {name: [slots, capacity]} what a press keeps per row (presses/base.py)
    next_logits [slots, vocab] float32    from the forward that wrote each newest row
    shares      [slots, capacity] float32 that forward's newest token's attention share of
                                          each row (mean over heads, then recorded layers)

A round (`apply`) takes one edit for every active sequence at once: the rows each deletes
(`deleted [active, capacity] bool`, rows before the round) and the token each adds. It plans
every mirror's layout first (nothing touched), closes the gaps of every edited slot with one
gather for all layers (`SlotKV.compact`), runs one forward that writes each new token's K/V
into the row after its slot's last and records the attention shares, and then commits each
mirror. A failure anywhere after the first change rebuilds every active sequence from its
mirror, which still describes the rows before the round: the round did not happen.

Joining and rebuilding go through the single-sequence `StateManager`, whose prefill,
pruning and checks are proven: its rows are copied into the slot. A sequence's mirror is the
same `Mirror` a `StateManager` keeps, so sessions, the terminal view and fixtures read it
unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mirror import Insertion, Mirror, plan_layout

from steps.attention import layer_indices

from ..kv import rope
from ..kv.slots import SlotKV
from ..models import attention
from ..models.compat import with_cache
from . import rows as row_plans
from .manager import StateManager
from .readonly import MirrorView


@dataclass
class RoundReport:
    """What one round did: `failed` lists the sequences whose edit did not happen (rebuilt from
    their mirrors, `error` says why; `rebuilt`: all of them, the round's writes failed)."""

    rebuilt: bool = False
    failed: list[int] = field(default_factory=list)
    error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)


class SlotState:
    """K/V and per-row tensors of up to `slots` sequences of `capacity` rows each, and their
    mirrors; see the module docstring. `score_layers`: the layers whose attention the shares
    average ("last", "all" or indices)."""

    def __init__(self, lm, *, slots: int, capacity: int, score_layers="last"):
        self.lm = lm
        self.attention_layers = layer_indices(score_layers, lm.num_layers)
        self.kv = SlotKV(layers=lm.num_layers, slots=slots, kv_heads=lm.num_kv_heads, capacity=capacity,
                         head_dim=lm.head_dim, dtype=lm.dtype, device=lm.device)
        device = lm.device
        self.length = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, capacity, dtype=torch.long, device=device)
        self.next_logits = torch.zeros(slots, lm.vocab_size, dtype=torch.float32, device=device)
        self.shares = torch.zeros(slots, capacity, dtype=torch.float32, device=device)
        self.row_state: dict[str, torch.Tensor] = {}
        self.row_fill: dict[str, float] = {}
        self._mirrors: list[Mirror] = []
        self._ticks: list[int] = []
        self._starts: list[float] = []  # the brightness a sequence's new ledger entries start at
        self.rebuilds = 0
        self.forward_seconds = 0.0  # the last round's model forward (its shares included)

    # --- reads ------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._mirrors)

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def mirror(self, slot: int) -> MirrorView:
        """Sequence `slot`'s mirror, read-only."""
        return MirrorView(self._mirrors[slot])

    def tick(self, slot: int) -> int:
        """Rounds sequence `slot` has made (its ledger's tick), counted from its join's `tick`."""
        return self._ticks[slot]

    def rows(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of sequence `slot`'s live K/V: keys, values `[layers, kv_heads, rows, head_dim]`."""
        return self.kv.read(slot, int(self.length[slot]))

    # --- sequences join and leave (between rounds) ---------------------------------------------

    def declare(self, name: str, dtype: torch.dtype, fill: float) -> None:
        """A press's per-row state `name`: `[slots, capacity]` of `dtype`, new rows at `fill`."""
        if name in self.row_state:
            if self.row_state[name].dtype != dtype or self.row_fill[name] != fill:
                raise ValueError(f"per-row state {name!r} is already kept as {self.row_state[name].dtype}, "
                                 f"new rows at {self.row_fill[name]}")
            return
        self.row_state[name] = torch.full(self.positions.shape, fill, dtype=dtype, device=self.positions.device)
        self.row_fill[name] = fill

    def join(self, manager: StateManager, *, tick: int = 0, row_state: dict[str, torch.Tensor] | None = None) -> int:
        """Take `manager`'s sequence into the next free slot (its mirror becomes this state's;
        the manager must not be used again) and return the slot. `row_state`: the press's
        per-row values of its live rows, `{name: [rows]}` (others start at their fill)."""
        if self.active == self.kv.slots:
            raise ValueError(f"all {self.kv.slots} slots are in use")
        rows = len(manager)
        if manager.per_layer or manager.kv_format != "float" or manager.kv_store != "splice":
            raise ValueError("Core v4 holds float rows shared by every layer (per-layer rows, 4-bit formats and the "
                             "ring store run on the single-sequence state)")
        if rows + 1 > self.capacity:
            raise ValueError(f"{rows} rows and the next token do not fit a slot of {self.capacity} rows")
        if manager.last_attention is None:
            raise ValueError("the joining state has no attention row (its last edit did not write the newest row)")
        slot = self.active
        saved = manager.tensors()
        self.kv.write(slot, saved["keys"], saved["values"])
        device = self.positions.device
        self.length[slot] = rows
        self.positions[slot].zero_()
        self.positions[slot, :rows] = torch.tensor(manager.positions(), dtype=torch.long, device=device)
        self._take_newest(slot, manager)
        for name, values in self.row_state.items():
            values[slot].fill_(self.row_fill[name])
        for name, values in (row_state or {}).items():
            self.row_state[name][slot, :rows] = values.to(device)
        self._mirrors.append(manager._mirror)
        self._ticks.append(tick)
        self._starts.append(manager.new_brightness)
        return slot

    def leave(self, slot: int) -> Mirror:
        """Sequence `slot` leaves; the last active sequence moves into its slot. Returns its mirror."""
        last = self.active - 1
        mirror = self._mirrors[slot]
        if slot != last:
            self.kv.move(last, slot)
            for tensor in (self.length, self.positions, self.next_logits, self.shares, *self.row_state.values()):
                tensor[slot] = tensor[last]
            self._mirrors[slot], self._ticks[slot] = self._mirrors[last], self._ticks[last]
            self._starts[slot] = self._starts[last]
        for records in (self._mirrors, self._ticks, self._starts):
            records.pop()
        return mirror

    def _take_newest(self, slot: int, manager: StateManager) -> None:
        """What the forward that wrote `manager`'s newest row left: its logits and shares."""
        rows = len(manager)
        self.next_logits[slot] = manager.next_logits.to(self.next_logits.device, torch.float32)
        self.shares[slot].zero_()
        self.shares[slot, :rows] = manager.last_attention.float().mean(dim=(0, 1)).to(self.shares.device)

    # --- the round -------------------------------------------------------------------------

    def apply(self, deleted: torch.Tensor, tokens: list[int], *, row_state: dict[str, torch.Tensor] | None = None,
              source: str = "generated") -> RoundReport:
        """One round for every active sequence: sequence s deletes its rows `deleted[s]`
        (`[active, capacity]` bool, rows before the round) and adds `tokens[s]`. `row_state`:
        the presses' per-row state after this round's scoring (`{name: [active, capacity]}`,
        rows before the round), adopted only if the round goes through. All or nothing: a
        failure rebuilds every sequence from its unchanged mirror (`RoundReport.rebuilt`)."""
        active = self.active
        if deleted.shape != (active, self.capacity) or len(tokens) != active:
            raise ValueError(f"a round of {active} sequences takes deleted [{active}, {self.capacity}] and "
                             f"{active} tokens, got {tuple(deleted.shape)} and {len(tokens)}")
        seconds, clock = {}, time.perf_counter()
        gone = [[] for _ in range(active)]
        for slot, row in deleted.nonzero().tolist():  # one copy to the host for the whole round
            gone[slot].append(row)
        plans = [self._plan(slot, gone[slot], tokens[slot], source) for slot in range(active)]
        seconds["plan"] = (now := time.perf_counter()) - clock
        report = RoundReport(seconds=seconds)
        before = {name: values[:active].clone() for name, values in self.row_state.items()}
        try:
            positions, states = self._write(deleted, gone, plans, row_state or {})
        except BaseException as exc:  # nothing committed: every mirror is the round's before
            report.rebuilt, report.failed, report.error = True, list(range(active)), f"{type(exc).__name__}: {exc}"
            self.rebuild()
            if not isinstance(exc, Exception):
                raise
            return report
        seconds["write"] = (clock := time.perf_counter()) - now
        self.length[:active] = torch.tensor([layout.length for layout, _ in plans], device=self.length.device)
        self.positions[:active] = positions
        for name, values in states.items():
            self.row_state[name][:active] = values
        slot = 0
        try:
            for slot, (layout, texts) in enumerate(plans):
                self._mirrors[slot].splice(layout, texts, tick=self._ticks[slot] + 1,
                                            brightness=self._starts[slot])
                self._ticks[slot] += 1
        except BaseException as exc:  # the sequences not committed go back to their mirrors
            report.failed, report.error = list(range(slot, active)), f"{type(exc).__name__}: {exc}"
            for name, values in before.items():
                self.row_state[name][slot:active] = values[slot:]
            self.rebuild(report.failed)
            if not isinstance(exc, Exception):
                raise
        seconds["commit"] = time.perf_counter() - clock
        return report

    def _plan(self, slot: int, gone: list[int], token: int, source: str):
        """Sequence `slot`'s layout after deleting rows `gone` and adding `token`, and the new
        token's text (nothing touched)."""
        mirror = self._mirrors[slot]
        layout = plan_layout(mirror.live.positions, gone, [Insertion(at=len(mirror), token_ids=(token,), source=source)],
                             self.lm.max_positions)
        return layout, row_plans.texts(self.lm.decode, mirror, layout)

    @torch.no_grad()
    def _write(self, deleted, gone, plans, row_state):
        """Close every edited slot's gaps, re-rotate keys whose position moved, and run the
        round's forward. Returns the positions and per-row state after the round (to commit)."""
        active, device = self.active, self.positions.device
        positions = self.positions[:active]
        states = {name: row_state.get(name, values[:active]) for name, values in self.row_state.items()}
        edited = [slot for slot in range(active) if gone[slot]]
        if edited:
            index = torch.tensor(edited, device=device)
            # kept rows first, in row order; the deleted ones after them (overwritten by later rows)
            order = torch.sort(deleted[index].to(torch.int8), dim=1, stable=True).indices
            self.kv.compact(index, order)
            positions = positions.clone()
            positions[index] = positions[index].gather(1, order)
            states = {name: _gathered(values, index, order) for name, values in states.items()}
        new_rows = torch.tensor([layout.length - 1 for layout, _ in plans], device=device)
        for slot, (layout, _) in enumerate(plans):
            if layout.moved is not None:  # the model's position limit: every row packed down
                self._rotate(slot, layout)
                positions = positions.clone() if positions is self.positions[:active] else positions
                positions[slot, : layout.length] = torch.tensor(layout.positions, device=device)
        new_positions = torch.tensor([layout.positions[-1] for layout, _ in plans], device=device)
        positions = positions.clone() if positions is self.positions[:active] else positions
        positions[torch.arange(active, device=device), new_rows] = new_positions
        for name, values in states.items():
            values = values.clone() if values is self.row_state[name][:active] else values
            values[torch.arange(active, device=device), new_rows] = torch.tensor(self.row_fill[name], dtype=values.dtype)
            states[name] = values
        clock = time.perf_counter()
        logits, shares = self._forward([layout.new_token_ids[-1] for layout, _ in plans], new_rows, new_positions)
        self.forward_seconds = time.perf_counter() - clock
        self.next_logits[:active] = logits
        self.shares[:active] = shares
        return positions, states

    def _rotate(self, slot: int, layout) -> None:
        """Keys of `slot` from row `layout.moved` on, from their old positions to their new ones."""
        first, last = layout.moved, layout.length - 1  # the new token is written at its own position
        cos, sin = rope.rotation(self.lm.inv_freq, torch.tensor(layout.old_positions[first:last]),
                                 torch.tensor(layout.positions[first:last]))
        keys = self.kv.keys[:, slot, :, first:last]
        self.kv.keys[:, slot, :, first:last] = rope.rotate(keys, cos.to(keys.device), sin.to(keys.device))

    def _forward(self, tokens: list[int], rows: torch.Tensor, positions: torch.Tensor):
        """One decode forward: sequence s's token at `positions[s]` written into its row `rows[s]`.
        Returns logits [active, vocab] float32 and shares [active, capacity] float32."""
        lm, active = self.lm, self.active
        visible = torch.arange(self.capacity, device=rows.device)[None] <= rows[:, None]  # [active, capacity]
        mask = torch.zeros(visible.shape, dtype=lm.dtype, device=rows.device)
        mask = mask.masked_fill_(~visible, torch.finfo(lm.dtype).min)[:, None, None]  # [active, 1, 1, capacity]
        seen = _Seen()
        with attention.tap(seen.see, layers=self.attention_layers, norms=seen.norm):
            out = lm.model(input_ids=torch.tensor(tokens, dtype=torch.long, device=lm.device)[:, None],
                           position_ids=positions[:, None], attention_mask=mask,
                           **with_cache(self.kv.cache(active, rows, mask)), use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()
        return logits, seen.shares(self.kv, self.attention_layers, active, mask[:, 0, 0])

    # --- failure ----------------------------------------------------------------------------

    def rebuild(self, slots=None) -> None:
        """Recompute sequences' rows from their mirrors (default: every active one)."""
        for slot in range(self.active) if slots is None else slots:
            manager = StateManager.from_mirror(self.lm, self._mirrors[slot], capacity=self.capacity,
                                               score_layers=self.attention_layers)
            rows = len(manager)
            saved = manager.tensors()
            self.kv.write(slot, saved["keys"], saved["values"])
            self.length[slot] = rows
            self.positions[slot, :rows] = torch.tensor(manager.positions(), dtype=torch.long)
            self._take_newest(slot, manager)
            self.rebuilds += 1


def _gathered(values: torch.Tensor, index: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`values` [active, capacity] with the rows of sequences `index` reordered by `order`."""
    values = values.clone()
    values[index] = values[index].gather(1, order)
    return values


class _Seen:
    """The newest token's query and log-normaliser on each recorded layer, as the model
    attended with them (the attention tap), for the round's shares."""

    def __init__(self):
        self.queries: dict[int, torch.Tensor] = {}
        self.norms: dict[int, torch.Tensor] = {}
        self.scaling = 1.0

    def see(self, module, query, key, value, scaling) -> None:
        """query [active, heads, 1, head_dim]"""
        self.queries[module.layer_idx] = query[:, :, -1].detach()
        self.scaling = scaling

    def norm(self, module, log_norm) -> None:
        """log_norm [active, heads, 1]: the kernel's log Σ exp over the rows it attended."""
        self.norms[module.layer_idx] = log_norm[:, :, -1]

    def shares(self, kv: SlotKV, layers: list[int], active: int, mask: torch.Tensor) -> torch.Tensor:
        """[active, capacity] float32: each row's attention share, mean over heads then layers.
        exp(logit − log-normaliser) is elementwise, so a row's share does not depend on how
        many other rows or sequences the product covered."""
        total = None
        for layer in layers:
            query = self.queries[layer].float() * self.scaling  # [active, heads, d]
            keys = kv.keys[layer, :active]  # [active, kv, capacity, d]
            heads, kv_heads = query.shape[1], keys.shape[1]
            logits = (query.reshape(active, kv_heads, heads // kv_heads, -1) @ keys.transpose(-1, -2).float())
            logits = logits.reshape(active, heads, -1) + mask.float()[:, None]
            norm = self.norms.get(layer)
            norm = logits.logsumexp(dim=-1) if norm is None else norm.float()
            share = (logits - norm[..., None]).exp().mean(dim=1)
            total = share if total is None else total + share
        return total / len(layers)
