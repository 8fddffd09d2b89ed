"""Core v4's state: many sequences in one set of tensors, edited a round at a time.

`SlotState` is the one writer of a `SlotKV` (positronic/kv/slots.py) and of the sequences'
mirrors. Sequence s lives in slot s (the first `active` slots are in use); its rows are
rows `0..length[s]-1` of the slot, and next to them the state keeps, as device tensors:

    length      [slots] int64                    live rows (the same in every lane)
    positions   [slots, lanes, capacity] int64   each row's RoPE position
    token_ids   [slots, lanes, capacity] int64   each row's token
    row_state   {name: [slots, capacity] or [slots, lanes, capacity]}
                                                 what a press keeps per row (presses/base.py)
    next_logits [slots, vocab] float32           from the forward that wrote each newest row
    shares      [slots, capacity] float32        that forward's newest token's attention share
                                                 of each row (mean over heads, then recorded
                                                 layers), for sequences whose lanes agree
    lane_shares [slots, lanes, capacity] float32 the same per lane (a lane's query heads), when
                                                 every layer is recorded
    lane_peaks  [slots, lanes, capacity] float32 the largest of a lane's heads' shares instead
                                                 of their mean (SmartKV's recent-use rank)
    attention   [slots, recorded layers, heads, capacity] float32
                                                 the shares before the mean (`last_attention`)
    row_state["predicted"] [slots, lanes, capacity] int64
                                                 each row's greedy next token (its forward's argmax)

A *lane* is a set of rows one part of the cache keeps (mirror/layer_rows.py): with `lanes`
1 every layer holds the same rows; with `lanes` = layers each layer keeps its own, and with
layers × kv_heads each kv head of each layer (SmartKV's per-layer memories). Every lane of a
sequence holds the same number of rows; a sequence whose mirror has no per-layer rows keeps
every lane alike, so one state serves both kinds.

A round (`apply`) takes one edit for every active sequence at once: the rows each deletes
(`deleted [active, capacity]` or, lane by lane, `[active, lanes, capacity]` bool, rows before
the round) and the token each adds. It plans
every mirror's layout first (nothing touched), closes the gaps of every edited slot with one
gather for all layers (`SlotKV.compact`), runs one forward that writes each new token's K/V
into the row after its slot's last and records the attention shares, and then commits each
mirror. A failure anywhere after the first change rebuilds every active sequence from its
mirror, which still describes the rows before the round: the round did not happen.

`apply_edits` makes a round from the Step 4 contract's action lists (one checked `Edit` a
sequence: deletes or a drop, and one add); what a round cannot make is refused by name.

Joining and rebuilding go through the single-sequence `StateManager`, whose prefill,
pruning and checks are proven: its rows are copied into the slot. A sequence's mirror is the
same `Mirror` a `StateManager` keeps, so sessions, the terminal view and fixtures read it
unchanged.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from positronic.mirror import Insertion, Mirror, plan_layout

from positronic.steps.attention import layer_indices

from ..kv import rope
from ..kv.slots import SlotKV
from ..models.compiled import CompiledRound, smallest_bucket
from ..models import attention
from ..models.lean import logits_of
from . import rows as row_plans
from .actions import ActionError
from .checks import StateInvariantError
from .edit import Bounds, Edit
from .manager import StateManager
from .plain import RESULTS, SETTLES, settle
from .readonly import MirrorView


@dataclass
class RoundReport:
    """What one round did: `failed` lists the sequences whose edit did not happen (rebuilt from
    their mirrors, `error` says why; `rebuilt`: all of them, the round's writes failed)."""

    rebuilt: bool = False
    failed: list[int] = field(default_factory=list)
    error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: list[int] | None = None  # a plain round's tokens (`SlotState.advance`)
    deleted: torch.Tensor | None = None  # a plain round's deleted rows: none, [active, lanes, capacity]


@dataclass(frozen=True)
class Inserts:
    """Rows coming back in a round (recall), up to J tokens per sequence, each into the lanes
    that take it (tokens those lanes do not hold), at its place in position order, with the
    K/V it had (keys rotated at its position) and its per-row state."""

    taken: torch.Tensor  # [active, lanes, J] bool: lane l of sequence s takes token j
    positions: torch.Tensor  # [active, J] int64
    token_ids: torch.Tensor  # [active, J] int64
    keys: torch.Tensor  # [active, J, layers, kv_heads, head_dim]
    values: torch.Tensor
    row_state: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [active, lanes, J] (or [active, J])


@dataclass
class Known:
    """What the host knows of the active sequences without reading the device: each one's live
    rows, the position its next token takes (one past its newest row's) and whether every
    sequence's next logits are finite. A plain round (`SlotState.advance`) needs all three
    before it starts, and keeps them (+1, +1, its own logits' check) without a wait."""

    lengths: list[int]
    reach: list[int]
    finite: bool


class SlotState:
    """K/V and per-row tensors of up to `slots` sequences of `capacity` rows each, and their
    mirrors; see the module docstring. `score_layers`: the layers whose attention the shares
    average ("last", "all" or indices). `lanes`: 1, the model's layers, or layers × kv heads."""

    def __init__(self, lm, *, slots: int, capacity: int, score_layers="last", lanes: int = 1, compiled: bool = False):
        if lanes not in (1, lm.num_layers, lm.num_layers * lm.num_kv_heads):
            raise ValueError(f"lanes must be 1, {lm.num_layers} (layers) or {lm.num_layers * lm.num_kv_heads} "
                             f"(layers x kv heads), got {lanes}")
        self.lm, self.lanes = lm, lanes
        self.attention_layers = layer_indices(score_layers, lm.num_layers)
        self.slots = slots
        # a compiled round may pad a lone sequence to two slots (CompiledRound): room for the second
        self.kv = SlotKV(layers=lm.num_layers, slots=max(slots, smallest_bucket(lm)) if compiled else slots,
                         kv_heads=lm.num_kv_heads,
                         capacity=capacity, head_dim=lm.head_dim, dtype=lm.dtype, device=lm.device)
        # the round's forward as one compiled graph, or None: eager (`_forward`)
        self.compiled = CompiledRound(lm, self.kv.keys, self.kv.values, self.attention_layers) if compiled else None
        device = lm.device
        # the per-slot tensors have the buffers' slots too: a compiled round's work before its
        # forward reads the first `bucket` of them (batch/plain.py), the padding ones unused
        slots = self.kv.slots
        self.length = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, lanes, capacity, dtype=torch.long, device=device)
        self.token_ids = torch.zeros(slots, lanes, capacity, dtype=torch.long, device=device)
        self.next_logits = torch.zeros(slots, lm.vocab_size, dtype=torch.float32, device=device)
        self.shares = torch.zeros(slots, capacity, dtype=torch.float32, device=device)
        self.lane_shares = torch.zeros(slots, lanes, capacity, dtype=torch.float32, device=device)
        self.lane_peaks = torch.zeros(slots, lanes, capacity, dtype=torch.float32, device=device)
        # that forward's attention itself, per recorded layer and query head (what a StateManager
        # keeps as `last_attention`: a sequence leaving into one scores its next tick from it)
        self.attention = torch.zeros(slots, len(self.attention_layers), lm.num_heads, capacity, dtype=torch.float32,
                                     device=device)
        self.row_state: dict[str, torch.Tensor] = {}
        self.row_fill: dict[str, float] = {}
        # each row's greedy next token from the forward that wrote it (ContextView.predicted)
        self.declare("predicted", torch.long, 0, lanes=True)
        # a press's per-sequence tensors (recall's index): name -> [slots, *shape], moved with the slot
        self.sequence_state: dict[str, torch.Tensor] = {}
        self.sequence_fill: dict[str, float] = {}
        # the newest token's query (scaled, rotated) and log-normaliser in every layer, when every
        # layer is recorded (recall scores its index with them)
        self.queries = torch.zeros(slots, lm.num_layers, lm.num_heads, lm.head_dim, dtype=torch.float32, device=device)
        self.log_norms = torch.zeros(slots, lm.num_layers, lm.num_heads, dtype=torch.float32, device=device)
        self._mirrors: list[Mirror] = []
        self._ticks: list[int] = []
        # rounds the mirrors have not taken yet: (deleted [active, lanes, capacity], tokens, sources,
        # rows coming back: (taken [active, lanes, J], positions [active, J]) or None) each,
        # and per sequence how many of them its mirror has (`_fold`)
        self._journal: list[tuple[torch.Tensor, list[int], list[str], tuple | None]] = []
        self._folded: list[int] = []
        self._starts: list[float] = []  # the brightness a sequence's new ledger entries start at
        self.rebuilds = 0
        self.forward_seconds = 0.0  # the last round's model forward (its shares included)
        self._known: Known | None = None  # `known()`: None until read again after a change
        self._no_deletes = torch.zeros(slots, lanes, capacity, dtype=torch.bool, device=device)  # a plain round's

    # --- reads ------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._mirrors)

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def mirror(self, slot: int) -> MirrorView:
        """Sequence `slot`'s mirror, read-only, with every round so far."""
        return MirrorView(self._fold(slot))

    def tick(self, slot: int) -> int:
        """Rounds sequence `slot` has made (its ledger's tick), counted from its join's `tick`."""
        return self._ticks[slot]

    def known(self) -> Known:
        """The active sequences' lengths, next positions and logits' finiteness on the host:
        kept by plain rounds, read from the device in one copy after anything else changed them."""
        if self._known is None:
            active = self.active
            live = torch.arange(self.capacity, device=self.length.device) < self.length[:active, None]
            reach = torch.where(live[:, None], self.positions[:active], -1).amax(dim=(1, 2)) + 1
            finite = torch.isfinite(self.next_logits[:active].amax(dim=-1))
            values = torch.cat([self.length[:active], reach, finite.long()]).tolist()
            self._known = Known(values[:active], values[active:2 * active], all(values[2 * active:]))
        return self._known

    def rows(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of sequence `slot`'s live K/V: keys, values `[layers, kv_heads, rows, head_dim]`."""
        return self.kv.read(slot, int(self.length[slot]))

    def read(self, slots: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row `rows[i]` of slot `slots[i]` in every lane ([n] int64 each): keys,
        values `[n, layers, kv_heads, head_dim]` (a row every lane holds: a press's window row)."""
        return self.kv.keys[:, slots, :, rows], self.kv.values[:, slots, :, rows]

    # --- sequences join and leave (between rounds) ---------------------------------------------

    def declare(self, name: str, dtype: torch.dtype, fill: float, *, lanes: bool = False) -> None:
        """A press's per-row state `name`: `[slots, capacity]` (`lanes`: `[slots, lanes,
        capacity]`) of `dtype`, new rows at `fill`."""
        shape = self.positions.shape if lanes else self.positions[:, 0].shape
        if name in self.row_state:
            if (self.row_state[name].dtype, self.row_state[name].shape, self.row_fill[name]) != (dtype, shape, fill):
                raise ValueError(f"per-row state {name!r} is already kept as {self.row_state[name].dtype} "
                                 f"{tuple(self.row_state[name].shape)}, new rows at {self.row_fill[name]}")
            return
        self.row_state[name] = torch.full(shape, fill, dtype=dtype, device=self.positions.device)
        self.row_fill[name] = fill

    def declare_sequence(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float) -> None:
        """A press's per-sequence tensor `name`: `[slots, *shape]` of `dtype`, a joining sequence's
        at `fill` unless it brings its own."""
        full = (self.slots, *shape)
        if name in self.sequence_state:
            kept = self.sequence_state[name]
            if (kept.dtype, tuple(kept.shape), self.sequence_fill[name]) != (dtype, full, fill):
                raise ValueError(f"per-sequence state {name!r} is already kept as {kept.dtype} {tuple(kept.shape)}, "
                                 f"filled with {self.sequence_fill[name]}")
            return
        self.sequence_state[name] = torch.full(full, fill, dtype=dtype, device=self.positions.device)
        self.sequence_fill[name] = fill

    def join(self, manager: StateManager, *, tick: int = 0, row_state: dict[str, torch.Tensor] | None = None,
             sequence_state: dict[str, torch.Tensor] | None = None) -> int:
        """Take `manager`'s sequence into the next free slot (its mirror becomes this state's;
        the manager must not be used again) and return the slot. `row_state`: the press's
        per-row values of its live rows, `{name: [rows]}` (others start at their fill);
        `sequence_state`: its per-sequence tensors (`declare_sequence`; others at their fill; a
        tensor shorter than the declared shape fills its leading part, the rest at the fill)."""
        if self.active == self.slots:
            raise ValueError(f"all {self.slots} slots are in use")
        rows = manager.rows_per_layer
        if manager.kv_format != "float" or manager.kv_store != "splice":
            raise ValueError("Core v4 holds float rows in the splice store (4-bit formats and the ring store run on "
                             "the single-sequence state)")
        if manager.per_layer and manager.mirror.layers.num_layers != self.lanes:
            raise ValueError(f"the joining state keeps {manager.mirror.layers.num_layers} lanes, this one {self.lanes}")
        if rows > self.capacity:
            raise ValueError(f"{rows} rows do not fit a slot of {self.capacity} rows")
        if manager.next_logits is None or (manager.last_attention is None and not manager.per_layer):
            raise ValueError("the joining state has no attention row (its last edit did not write the newest row)")
        for name, values in (sequence_state or {}).items():
            shape = self.sequence_state[name].shape[1:]
            if values.dim() != len(shape) or any(a > b for a, b in zip(values.shape, shape)):
                raise ValueError(f"per-sequence state {name!r} is {tuple(shape)} a sequence, got {tuple(values.shape)}")
        slot = self.active
        self._known = None
        saved = manager.tensors()
        self.kv.write(slot, saved["keys"], saved["values"])
        self.length[slot] = rows
        self._set_rows(slot, manager._mirror)
        self._take_newest(slot, manager)
        for name, values in self.row_state.items():
            values[slot].fill_(self.row_fill[name])
        for name, values in (row_state or {}).items():
            self.row_state[name][slot, ..., :rows] = values.to(self.positions.device)
        self._set_predicted(slot, manager._mirror, manager._predicted)
        for name, values in self.sequence_state.items():
            values[slot].fill_(self.sequence_fill[name])
        for name, values in (sequence_state or {}).items():
            target = self.sequence_state[name][slot]
            target[tuple(slice(0, size) for size in values.shape)] = values.to(self.positions.device)
        self._mirrors.append(manager._mirror)
        self._folded.append(len(self._journal))
        self._ticks.append(tick)
        self._starts.append(manager.new_brightness)
        return slot

    def leave(self, slot: int) -> Mirror:
        """Sequence `slot` leaves; the last active sequence moves into its slot. Returns its mirror."""
        self.fold()  # the journal's rounds name sequences by slot: taken before a slot changes hands
        self._known = None
        last = self.active - 1
        mirror = self._mirrors[slot]
        if slot != last:
            self.kv.move(last, slot)
            for tensor in (self.length, self.positions, self.token_ids, self.next_logits, self.shares,
                           self.lane_shares, self.lane_peaks, self.attention, self.queries, self.log_norms,
                           *self.row_state.values(),
                           *self.sequence_state.values()):
                tensor[slot] = tensor[last]
            self._mirrors[slot], self._ticks[slot] = self._mirrors[last], self._ticks[last]
            self._starts[slot] = self._starts[last]
        for records in (self._mirrors, self._ticks, self._starts, self._folded):
            records.pop()
        return mirror

    def copy_out(self, slot: int, *, capacity: int, brightness: list[float] | None = None) -> StateManager:
        """Sequence `slot` as a StateManager of its own (`capacity` rows), its rows copied out as
        they are, so it ticks on alone exactly as if it had made its rounds itself; it stays in
        its slot until `leave` (its mirror is the manager's now: it must not run another round).
        `brightness`: its live rows' brightness, which a press kept
        (the mirror's ledger takes it). The copy is checked as a resumed session's is (layer 0
        against a fresh prefill of the mirror, `StateManager.from_saved`); a copy that fails
        the check is rebuilt from the mirror instead. With lanes apart (a per-layer mirror) each
        lane's rows go into the state's own rows for it, and the newest query and log-normaliser
        of every layer with them (what a per-layer state records instead of an attention row)."""
        mirror = self._fold(slot)
        rows = int(self.length[slot])
        keys, values = self.rows(slot)
        # copies, never views of the slot: the next sequence in it overwrites them (`.cpu()` on the CPU copies nothing)
        tensors = {"keys": keys.cpu(), "values": values.cpu(), "predicted": self._live_predicted(slot, mirror),
                   "next_logits": self.next_logits[slot].to("cpu", copy=True)}
        if mirror.layers is None:
            tensors["last_attention"] = self.attention[slot, :, :, :rows].to("cpu", copy=True).contiguous()
        elif self._every_lane(len(self.attention_layers)) and bool(self.log_norms[slot].any()):
            tensors |= {"last_query": self.queries[slot].to("cpu", copy=True),
                        "last_log_norm": self.log_norms[slot].to("cpu", copy=True)}
        if brightness is not None:
            mirror.set_brightness(brightness)
        options = dict(capacity=capacity, score_layers=self.attention_layers, brightness=self._starts[slot])
        try:
            manager = StateManager.from_saved(self.lm, mirror, tensors, **options)
        except (ValueError, StateInvariantError):  # the copy does not describe the mirror: recompute it
            manager = StateManager.from_mirror(self.lm, mirror, **options)
            self.rebuilds += 1
        return manager

    def _live_predicted(self, slot: int, mirror: Mirror) -> torch.Tensor:
        """[live rows] int64: each live token's prediction (the mirror's live order), from the
        lane that holds it (the union of the lanes' rows, with lanes apart)."""
        rows = int(self.length[slot])
        predicted = self.row_state["predicted"][slot, :, :rows].cpu()
        if mirror.layers is None:
            return predicted[0].clone()
        ids = torch.tensor(mirror.layers.rows, dtype=torch.long).flatten()  # [lanes * rows]
        order = torch.sort(ids, stable=True)
        at = torch.searchsorted(order.values, torch.tensor(mirror.live.ledger_ids, dtype=torch.long))
        return predicted.flatten()[order.indices[at]]  # a live token is in some lane: found

    def _set_rows(self, slot: int, mirror: Mirror) -> None:
        """Slot `slot`'s positions and token ids, lane by lane, from `mirror` (its rows as a
        StateManager lays them out: the live map's, or each lane's own with per-layer rows)."""
        entries = mirror.ledger.entries
        positions = self._by_lane(mirror, mirror.live.positions)
        tokens = self._by_lane(mirror, [entries[i].token_id for i in mirror.live.ledger_ids])
        self.positions[slot].zero_()
        self.token_ids[slot].zero_()
        self.positions[slot, :, :positions.shape[1]] = positions
        self.token_ids[slot, :, :tokens.shape[1]] = tokens

    def _set_predicted(self, slot: int, mirror: Mirror, predicted: list[int]) -> None:
        """Slot `slot`'s per-row predictions, lane by lane, from a StateManager's (`predicted`:
        one per live row of `mirror`)."""
        by_lane = self._by_lane(mirror, predicted)
        values = self.row_state["predicted"]
        values[slot].zero_()
        values[slot, :, : by_lane.shape[1]] = by_lane

    def _by_lane(self, mirror: Mirror, live_values: list[int]) -> torch.Tensor:
        """[lanes, rows] int64: `live_values` (one per live row of `mirror`, in its live order) laid
        out as the lanes hold the rows (the live map's order in every lane, or each lane's own)."""
        values = torch.tensor(live_values, dtype=torch.long)
        if mirror.layers is None:
            return values.expand(self.lanes, -1).to(self.positions.device)
        live = torch.tensor(mirror.live.ledger_ids, dtype=torch.long)
        order = torch.sort(live)
        lanes = torch.tensor(mirror.layers.rows, dtype=torch.long)  # [lanes, rows] ledger ids
        at = torch.searchsorted(order.values, lanes)  # every lane's row is a live token
        return values[order.indices[at]].to(self.positions.device)

    def _take_newest(self, slot: int, manager: StateManager) -> None:
        """What the forward that wrote `manager`'s newest row left: its logits, and its shares
        where the rows are shared. A per-layer state records no attention row, but the newest
        query and log-normaliser of every layer when all are recorded: the lane shares are
        taken from those and the lanes' keys (just written), as `RowReader.lane_scores` does."""
        rows = len(manager)
        self.next_logits[slot] = manager.next_logits.to(self.next_logits.device, torch.float32)
        self.shares[slot].zero_()
        self.attention[slot].zero_()
        self.lane_shares[slot].zero_()
        self.lane_peaks[slot].zero_()
        self.queries[slot].zero_()
        self.log_norms[slot].zero_()
        # a per-layer state's forward may leave one layer's attention (its own rows, not the union's:
        # seen on a GPU); its lane shares come from the queries below
        if manager.last_attention is not None and not manager.per_layer:
            self.shares[slot, :rows] = manager.last_attention.float().mean(dim=(0, 1)).to(self.shares.device)
            self.attention[slot, :, :, :rows] = manager.last_attention.float().to(self.attention.device)
        query, norm = manager.last_query, manager.last_log_norm
        if (manager.per_layer and query is not None and norm is not None and len(query) == self.lm.num_layers
                and self._every_lane(len(self.attention_layers))):
            self.queries[slot] = query.to(self.queries.device, torch.float32)
            self.log_norms[slot] = norm.to(self.log_norms.device, torch.float32)
            rows = manager.rows_per_layer
            keys = self.kv.keys[:, slot, :, :rows]  # [layers, kv_heads, rows, head_dim]
            logits = attention.grouped_logits(query, keys.transpose(-1, -2), norm)  # [layers, kv, group, rows]
            logits = logits.reshape(self.lanes, -1, rows)  # a lane's query heads together
            self.lane_shares[slot, :, :rows] = logits.exp().mean(dim=1)
            self.lane_peaks[slot, :, :rows] = logits.amax(dim=1).exp()

    def _every_lane(self, recorded: int) -> bool:
        """Whether lane shares are taken: lanes apart and `recorded` layers (every one)."""
        return self.lanes > 1 and recorded == self.lm.num_layers

    # --- the round -------------------------------------------------------------------------

    def apply(self, deleted: torch.Tensor, tokens: list[int], *, row_state: dict[str, torch.Tensor] | None = None,
              source: str | list[str] = "generated", inserts: Inserts | None = None,
              sequence_state: dict[str, torch.Tensor] | None = None, sequence_writes: dict | None = None) -> RoundReport:
        """One round for every active sequence: sequence s deletes its rows `deleted[s]`
        (`[active, capacity]`, or `[active, lanes, capacity]` lane by lane: bool, rows before
        the round; every lane of a sequence keeps as many) and adds `tokens[s]` to every lane,
        its ledger source `source` (one for all, or `source[s]`: "user" for typed input).
        `inserts`: tokens coming back into lanes that lack them (recall), each at its place in
        position order with its stored K/V, in the same compaction (a lane's kept rows plus
        its inserts are as many in every lane of a sequence). `row_state`: the presses'
        per-row state after this round's scoring (rows before the round), adopted only if the
        round goes through, as are the presses' per-sequence tensors (`sequence_state`,
        `sequence_writes`: `_adopt_sequences`). All or nothing: a failure rebuilds
        every sequence from its mirror (`RoundReport.rebuilt`).

        The mirrors take the round later (`_fold`, when one is read): the round records its
        edit (the deleted mask and the tokens) and the device tensors are the truth meanwhile,
        so a round costs no Python per sequence. A round that reaches the model's position
        limit folds that sequence's mirror at once and lets it lay the rows out."""
        active, device = self.active, self.positions.device
        if deleted.dim() == 2:
            deleted = deleted[:, None].expand(-1, self.lanes, -1)
        if deleted.shape != (active, self.lanes, self.capacity) or len(tokens) != active:
            raise ValueError(f"a round of {active} sequences takes deleted [{active}, {self.capacity}] or "
                             f"[{active}, {self.lanes}, {self.capacity}] and {active} tokens, got "
                             f"{tuple(deleted.shape)} and {len(tokens)}")
        clock = time.perf_counter()
        self._known = None
        live = (torch.arange(self.capacity, device=device) < self.length[:active, None])[:, None]  # [active, 1, capacity]
        deleted = deleted & live
        kept = live & ~deleted
        counts = kept.sum(dim=2)  # [active, lanes]
        if inserts is not None:
            self._check_inserts(inserts, kept)
            counts = counts + inserts.taken.sum(dim=2)
        if bool((counts != counts[:, :1]).any()):
            slot = int((counts != counts[:, :1]).any(dim=1).nonzero()[0, 0])
            raise ValueError(f"sequence {slot}: its lanes would keep different numbers of rows "
                             f"({sorted(set(counts[slot].tolist()))})")
        length = counts[:, 0] + 1
        if bool((length > self.capacity).any()):
            slot = int((length > self.capacity).nonzero()[0, 0])
            raise ValueError(f"sequence {slot}: {int(length[slot])} rows after the round do not fit a slot of "
                             f"{self.capacity} rows (its press must free rows first)")
        # after the union's last kept row (every lane holds the newest rows: the window)
        position = torch.where(kept, self.positions[:active], -1).amax(dim=(1, 2)) + 1
        limited = (position >= self.lm.max_positions).nonzero().flatten().tolist()
        if inserts is not None and limited and bool(inserts.taken[limited].any()):
            raise ValueError(f"sequence {limited[0]}: rows come back in the round that packs its positions")
        sources = [source] * active if isinstance(source, str) else list(source)
        if len(sources) != active:
            raise ValueError(f"a round of {active} sequences takes one source or {active}, got {len(sources)}")
        packed = {slot: self._pack(slot, deleted[slot], tokens[slot], sources[slot]) for slot in limited}
        report = RoundReport(seconds={"plan": (now := time.perf_counter()) - clock})
        try:
            self._write(deleted, kept, length, position, tokens, packed, row_state or {}, inserts)
            self._adopt_sequences(sequence_state or {}, sequence_writes or {})
        except BaseException as exc:  # nothing recorded: every mirror (with the rounds before) is the truth
            report.rebuilt, report.failed, report.error = True, list(range(active)), f"{type(exc).__name__}: {exc}"
            self.rebuild()
            if not isinstance(exc, Exception):
                raise
            return report
        back = None if inserts is None else (inserts.taken, inserts.positions)
        self._journal.append((deleted, list(tokens), sources, back))
        for slot in range(active):
            self._ticks[slot] += 1
        report.seconds["write"] = time.perf_counter() - now
        return report

    def advance(self, tokens: torch.Tensor, *, row_state: dict[str, torch.Tensor] | None = None) -> RoundReport:
        """A plain round: every active sequence adds `tokens[s]` (int64, on the device) and deletes
        nothing, takes nothing back and stays below the model's position limit (the caller knows
        it from `known()`). `row_state`: the presses' per-row state after this round's scoring, as
        `apply` takes it. The same tensors as `apply` with nothing deleted, bit for bit, without
        its plan, checks and gathers: the forward writes the new rows' K/V after the live ones,
        `settle` (state/plain.py) the rest, and `known()` moves on without a read (the tokens and
        the new logits' finiteness come back in one copy). In a compiled state `tokens` and the
        row state may cover the round's whole bucket (`compiled.bucket(active)` slots, the
        padding ones' values unused), and the forward and the writes are a compiled call each.
        `RoundReport.tokens` holds the tokens as ints. A failure rebuilds every sequence from its
        mirror, as `apply`'s does."""
        active, device, known = self.active, self.positions.device, self.known()
        size = active if self.compiled is None else self.compiled.bucket(active)
        if tokens.dim() != 1 or len(tokens) not in (active, size):
            raise ValueError(f"a round of {active} sequences takes {active} tokens, got {tuple(tokens.shape)}")
        if any(reach >= self.lm.max_positions for reach in known.reach):
            raise ValueError("a plain round cannot pack positions: a sequence is at the model's position limit")
        if any(length >= self.capacity for length in known.lengths):
            raise ValueError(f"a plain round adds a row: a sequence holds all {self.capacity} rows of its slot")
        clock = time.perf_counter()
        report = RoundReport(seconds={"plan": 0.0})
        try:
            pad = [0] * (size - active)  # padding slots: token 0 (or the prelude's), row 0, position 0
            at = torch.tensor([known.lengths + pad, known.reach + pad], device=device)  # [2, size]: new rows, positions
            new_rows, position = at[0], at[1]
            if len(tokens) < size:
                tokens = torch.cat([tokens, tokens.new_zeros(size - len(tokens))])
            scored = {name: values if len(values) == size else torch.cat([values, self.row_state[name][active:size]])
                      for name, values in (row_state or {}).items()}
            finite = self._settle(tokens, new_rows, position, self._run_forward(tokens, new_rows, position), scored)
            made = torch.cat([tokens[:active], finite[:active].long()]).tolist()  # the round's one wait
        except BaseException as exc:  # as `apply`: every mirror (with the rounds before) is the truth
            report.rebuilt, report.failed, report.error = True, list(range(active)), f"{type(exc).__name__}: {exc}"
            self.rebuild()
            if not isinstance(exc, Exception):
                raise
            return report
        report.tokens, report.deleted = made[:active], self._no_deletes[:active]
        self._journal.append((report.deleted, report.tokens, ["generated"] * active, None))
        for slot in range(active):
            self._ticks[slot] += 1
            known.lengths[slot] += 1
            known.reach[slot] += 1
        known.finite = all(made[active:])
        report.seconds["write"] = time.perf_counter() - clock
        return report

    def _settle(self, tokens, new_rows, position, results: tuple, scored: dict[str, torch.Tensor]) -> torch.Tensor:
        """`settle` of a plain round (state/plain.py) on this state's tensors, compiled in a compiled state."""
        fills = tuple((name, self.row_fill[name]) for name in self.row_state if name != "predicted")
        buffers = {name: getattr(self, name) for name in ("length", "positions", "token_ids", *RESULTS)}
        arguments = (tokens, new_rows, position, results, buffers, self.row_state, scored)
        if self.compiled is None:
            return settle(fills, *arguments)
        return SETTLES(fills, functools.partial(settle, fills), *arguments)

    def bounds(self, slot: int) -> Bounds:
        """What an action list for sequence `slot` is checked against (`Edit.from_actions`), as
        `StateManager.bounds` says for the same sequence: its live rows, and with per-lane rows
        (lanes, rows a lane)."""
        mirror = self._fold(slot)
        lanes = None if mirror.layers is None else (self.lanes, int(self.length[slot]))
        return Bounds(len(mirror), self.lm.vocab_size, self.lm.max_positions, lanes)

    def apply_edits(self, edits: list[Edit], *, source: str | list[str] = "generated") -> RoundReport:
        """A round from the Step 4 contract's action lists: `edits[s]` (an `Edit` checked against
        `bounds(s)`) for sequence s, its deletes (or a per-lane state's drops) and its one add made
        into `apply`'s deleted rows and token. What a round does not do is refused with an
        ActionError naming the sequence, before anything changes: a repair (replace_pair: new
        tokens in the middle need a forward of their own), a restore (rows come back through
        their press, recall, whose K/V it keeps), and a list without exactly one add (every
        sequence adds one token a round)."""
        if len(edits) != self.active:
            raise ValueError(f"a round of {self.active} sequences takes {self.active} edits, got {len(edits)}")
        deleted = torch.zeros((self.active, self.lanes, self.capacity), dtype=torch.bool)
        tokens = []
        for slot, edit in enumerate(edits):
            if edit.bounds != self.bounds(slot):
                raise ActionError(f"sequence {slot}: the edit was checked against {edit.bounds}, the sequence's "
                                  f"are {self.bounds(slot)} (Edit.from_actions(actions, state.bounds(slot)))")
            refused = ("replace_pair (a repair) runs on the single-sequence state" if edit.replacements else
                       "restore: rows come back in a round through their press (recall)" if edit.restores else
                       f"a round adds one token to every sequence, this list adds {len(edit.adds)}"
                       if len(edit.adds) != 1 else None)
            if refused:
                raise ActionError(f"sequence {slot}: {refused}")
            if edit.drops is not None:
                for lane, rows in enumerate(edit.drops):
                    deleted[slot, lane, list(rows)] = True
            else:
                deleted[slot, :, list(edit.deletes)] = True
            tokens.append(edit.adds[0])
        return self.apply(deleted.to(self.positions.device), tokens, source=source)

    def _check_inserts(self, inserts: Inserts, kept: torch.Tensor) -> None:
        """ValueError unless `inserts` fit this round: its shapes, lanes that hold rows apart,
        and no lane taking back a token it keeps."""
        active, lanes = kept.shape[:2]
        taken = inserts.taken
        if taken.dim() != 3 or taken.shape[:2] != (active, lanes) or inserts.positions.shape != (active, taken.shape[2]):
            raise ValueError(f"rows coming back take taken [{active}, {lanes}, J] and positions [{active}, J], got "
                             f"{tuple(taken.shape)} and {tuple(inserts.positions.shape)}")
        if not bool(taken.any()):
            return
        if lanes == 1:
            raise ValueError("rows come back lane by lane: this state keeps every lane alike")
        held = kept[..., None] & (self.positions[:active, :, :, None] == inserts.positions[:, None, None, :])
        clash = (held.any(dim=2) & taken).nonzero()
        if len(clash):
            slot, lane, j = clash[0].tolist()
            raise ValueError(f"sequence {slot}: lane {lane} takes back position {int(inserts.positions[slot, j])}, "
                             "which it holds")

    def _adopt_sequences(self, replaced: dict[str, torch.Tensor], writes: dict) -> None:
        """The presses' per-sequence tensors after the round: `replaced` {name: [active, ...]},
        then `writes` {name: (slots [n], items [n], values [n, ...], axis)}: `values[i]` into
        `tensor[slots[i]]` at item `items[i]` of the tensor's axis `axis` (recall's ring)."""
        for name, values in replaced.items():
            self.sequence_state[name][: len(values)] = values
        for name, (slots, items, values, axis) in writes.items():
            if len(slots):
                tensor = self.sequence_state[name]
                where = [slice(None)] * tensor.dim()
                where[0], where[axis] = slots, items
                tensor[tuple(where)] = values.to(tensor.dtype)

    def _edit(self, mirror: Mirror, deleted: torch.Tensor, token: int, source: str, inserts: list[list[int]] | None = None):
        """The mirror's plan of one round of one sequence (`deleted` [lanes, capacity] on the
        host; `inserts`: the ledger ids each lane takes back): (layout, per-lane drops or None)."""
        if mirror.layers is None:
            gone = deleted[0].nonzero().flatten().tolist()
            return plan_layout(mirror.live.positions, gone, [Insertion(at=len(mirror), token_ids=(token,),
                                                                       source=source)], self.lm.max_positions), None
        drops = [lane.nonzero().flatten().tolist() for lane in deleted]
        heads = self.lanes // self.lm.num_layers
        return row_plans.LaneRows(mirror, drops, [token], source, self.lm.max_positions, heads,
                                  inserts=inserts).layout, drops

    def _pack(self, slot: int, deleted: torch.Tensor, token: int, source: str):
        """Sequence `slot`'s layout after this round when its new token would pass the model's
        position limit: every row packed down to 0, 1, 2, ... (mirror.plan_layout's rule)."""
        mirror = self._fold(slot)
        layout, _ = self._edit(mirror, deleted.cpu(), token, source)
        return layout

    @torch.no_grad()
    def _write(self, deleted, kept, length, position, tokens, packed, row_state, inserts=None) -> None:
        """Close every edited slot's gaps lane by lane (kept rows first, in row order; rows
        coming back merged in by position, their stored K/V written), move the positions of a
        packed slot (re-rotating its keys), run the round's forward, then take its results.
        Until the forward has returned only the K/V buffers have changed."""
        active, device, capacity = self.active, self.positions.device, self.capacity
        rows = torch.arange(active, device=device)
        positions, token_ids = self.positions[:active], self.token_ids[:active]
        stored = None
        if inserts is None or not bool(inserts.taken.any()):
            order = torch.sort((~kept).to(torch.int8), dim=2, stable=True).indices  # [active, lanes, capacity]
            edited = deleted.any(dim=2).any(dim=1).nonzero().flatten()
            inserts = None
        else:  # kept rows and rows coming back, each lane in position order (rows ascend with position)
            taken, lanes = inserts.taken, self.lanes
            back = inserts.positions[:, None].expand(-1, lanes, -1)
            never = torch.iinfo(torch.long).max
            key = torch.cat([torch.where(kept, positions, never), torch.where(taken, back, never)], dim=2)
            order = torch.sort(key, dim=2, stable=True).indices[:, :, :capacity]
            row = torch.arange(capacity, device=device)
            order = torch.where((row >= length[:, None, None] - 1) & (order >= capacity), row, order)  # past the rows: stay
            edited = (deleted.any(dim=2) | taken.any(dim=2)).any(dim=1).nonzero().flatten()
            positions, token_ids = torch.cat([positions, back], dim=2), torch.cat(
                [token_ids, inserts.token_ids[:, None].expand(-1, lanes, -1)], dim=2)
            stored = (inserts.keys[edited], inserts.values[edited])
        if len(edited):
            self.kv.compact(edited, order[edited], stored)
        positions = positions.gather(2, order)
        for slot, layout in packed.items():  # every row keeps its place; positions move to the layout's
            added = set(layout.new_rows)  # (an added row's "old" position is its new one: left out)
            new_of = {old: new for row, (old, new) in enumerate(zip(layout.old_positions, layout.positions))
                      if row not in added}
            kept_rows = int(length[slot]) - 1  # every lane's (the layout's length is the union's)
            old = positions[slot, :, :kept_rows]
            new = torch.tensor([[new_of[p] for p in lane] for lane in old.tolist()], device=device)
            self._rotate(slot, old, new)
            positions[slot, :, :kept_rows] = new
            position[slot] = layout.positions[-1]
        new_rows = length - 1
        positions[rows, :, new_rows] = position[:, None]
        token_ids = token_ids.gather(2, order)
        token_ids[rows, :, new_rows] = torch.tensor(tokens, device=device)[:, None]
        states = {}
        for name, values in self.row_state.items():
            values = row_state.get(name, values[:active])
            if inserts is not None:  # rows coming back: their own state, or the fill
                given = inserts.row_state.get(name)
                if given is None:
                    given = torch.full((*values.shape[:-1], inserts.taken.shape[2]), self.row_fill[name],
                                       dtype=values.dtype, device=device)
                values = torch.cat([values, given.to(values.dtype)], dim=-1)
            values = values.gather(1, order[:, 0]) if values.dim() == 2 else values.gather(2, order)
            values[rows, ..., new_rows] = torch.tensor(self.row_fill[name], dtype=values.dtype, device=device)
            states[name] = values
        results = self._run_forward(token_ids[rows, 0, new_rows], new_rows, position)
        states["predicted"][rows, :, new_rows] = results[0].argmax(dim=-1)[:, None]
        self._take_results(results)
        self.length[:active], self.positions[:active], self.token_ids[:active] = length, positions, token_ids
        for name, values in states.items():
            self.row_state[name][:active] = values

    def _run_forward(self, tokens: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> tuple:
        """`_forward`, timed (`forward_seconds`)."""
        clock = time.perf_counter()
        results = self._forward(tokens, rows, positions)
        self.forward_seconds = time.perf_counter() - clock
        return results

    def _take_results(self, results: tuple) -> None:
        """What a round's forward left for the next round (`_forward`'s results): its logits and shares."""
        for name, value in zip(RESULTS, results):
            if value is not None:
                getattr(self, name)[: self.active] = value

    def _fold(self, slot: int) -> Mirror:
        """Sequence `slot`'s mirror with every round since it was last read: each round's
        layout planned and spliced in as `StateManager` would have (the same ticks, texts,
        positions and per-lane rows), which the device tensors already hold."""
        mirror, start = self._mirrors[slot], self._folded[slot]
        rounds = [entry for entry in self._journal[start:] if slot < len(entry[1])]
        if rounds:
            gone = torch.stack([entry[0][slot] for entry in rounds]).cpu()  # one copy: [rounds, lanes, capacity]
            tick = self._ticks[slot] - len(rounds)
            for deleted, (_, tokens, sources, back) in zip(gone, rounds):
                tick += 1
                inserts = self._taken_back(mirror, back[0][slot], back[1][slot]) if back is not None else None
                layout, drops = self._edit(mirror, deleted, tokens[slot], sources[slot], inserts)
                mirror.splice(layout, row_plans.texts(self.lm.decode, mirror, layout), tick=tick,
                              brightness=self._starts[slot], layer_drops=drops, layer_inserts=inserts)
        self._folded[slot] = len(self._journal)
        if all(done == len(self._journal) for done in self._folded):
            self._journal.clear()
            self._folded = [0] * len(self._folded)
        return mirror

    @staticmethod
    def _taken_back(mirror: Mirror, taken: torch.Tensor, positions: torch.Tensor) -> list[list[int]] | None:
        """The ledger ids each lane takes back in a round (`taken` [lanes, J], `positions` [J]),
        found by position: a live token's, else the newest culled one's (None: none come back)."""
        taken = taken.cpu()
        if not bool(taken.any()):
            return None
        wanted = positions.cpu().tolist()
        where = dict(zip(mirror.live.positions, mirror.live.ledger_ids))
        missing = set(wanted) - set(where)
        if missing:
            for ledger_id, entry in enumerate(mirror.ledger.entries):
                if entry.state == "culled" and entry.position in missing:
                    where[entry.position] = ledger_id
        return [sorted(where[wanted[j]] for j in lane.nonzero().flatten().tolist()) for lane in taken]

    def fold(self) -> None:
        """Bring every mirror up to the last round."""
        for slot in range(self.active):
            self._fold(slot)

    def _rotate(self, slot: int, old: torch.Tensor, new: torch.Tensor) -> None:
        """Keys of rows `0..n-1` of `slot`, lane by lane, from positions `old` to `new`
        ([lanes, n] each): a lane is every layer, one layer, or one kv head of one layer."""
        layers, kv_heads, rows = self.lm.num_layers, self.lm.num_kv_heads, old.shape[1]
        for lane in range(self.lanes):
            if self.lanes == 1:
                where = (slice(None), slot, slice(None), slice(0, rows))
            elif self.lanes == layers:
                where = (lane, slot, slice(None), slice(0, rows))
            else:
                where = (lane // kv_heads, slot, slice(lane % kv_heads, lane % kv_heads + 1), slice(0, rows))
            cos, sin = rope.rotation(self.lm.inv_freq, old[lane].cpu(), new[lane].cpu())
            keys = self.kv.keys[where]
            self.kv.keys[where] = rope.rotate(keys, cos.to(keys.device), sin.to(keys.device))

    def _forward(self, tokens: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor):
        """One decode forward: sequence s's token at `positions[s]` written into its row `rows[s]`.
        Returns logits [S, vocab], shares [S, recorded layers, heads, capacity] and their mean
        [S, capacity], and with every layer recorded lane shares and lane peaks [S, lanes,
        capacity], the queries (scaled) [S, layers, heads, head_dim] and log-normalisers [S,
        layers, heads] (else None for these four), all float32; S = len(tokens)."""
        if self.compiled is not None:
            logits, per_head, mean, queries, norms = self.compiled(tokens, rows, positions)
        else:
            logits, per_head, queries, norms = self._eager(tokens, rows, positions)
            mean = per_head.mean(dim=(1, 2))
        if not self._every_lane(len(self.attention_layers)):  # lane shares stay the zeros they are
            return logits, per_head, mean, None, None, None, None
        per_lane = per_head.reshape(len(tokens), self.lanes, -1, self.capacity)  # a lane's query heads together
        return logits, per_head, mean, per_lane.mean(dim=2), per_lane.amax(dim=2), queries, norms

    def _eager(self, tokens: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor):
        """The round's forward through the model's modules (`logits_of`), its attention read by
        the tap: logits, shares, and with every layer recorded queries and norms (else None)."""
        lm, active = self.lm, self.active
        mask = attention.decode_mask(rows, self.capacity, lm.dtype)  # [active, 1, 1, capacity]
        seen = _Seen()
        with attention.tap(seen.see, layers=self.attention_layers, norms=seen.norm):
            logits = logits_of(lm.model, tokens[:, None], positions[:, None], self.kv.cache(active, rows, mask), mask,
                               last=True)[:, -1].float()
        per_head = seen.shares(self.kv, self.attention_layers, active, mask[:, 0, 0])  # [active, layers, heads, capacity]
        queries = norms = None
        if self._every_lane(len(self.attention_layers)):
            queries = torch.stack([seen.queries[layer].float() * seen.scaling for layer in range(lm.num_layers)], dim=1)
            norms = torch.stack([seen.norms[layer].float() for layer in range(lm.num_layers)], dim=1)
        return logits, per_head, queries, norms

    @torch.no_grad()
    def warm(self, scored: Callable[[int], dict[str, torch.Tensor]] | None = None) -> int:
        """With no sequence in: run the compiled round once at every bucket (row 0 of the first
        slots gets the rows of token 0, which a joining sequence writes over), so that each
        graph is made now; with `scored` (a bucket's size -> the presses' next row state, as a
        plain round's prelude gives it) a plain round's writes after it too, into the same
        empty slots. Returns the graphs made (0 for an eager state)."""
        if self.active:
            raise ValueError(f"a state is warmed before sequences join; {self.active} have")
        if self.compiled is None:
            return 0
        made = self.compiled.compiles + SETTLES.compiles
        for size in self.compiled.sizes:
            # three tensors, as a round passes them: one passed thrice would be a graph of its own
            zeros = [torch.zeros(size, dtype=torch.long, device=self.positions.device) for _ in range(3)]
            results = self._forward(*zeros)
            if scored is not None:
                self._settle(*zeros, results, scored(size))
        return self.compiled.compiles + SETTLES.compiles - made

    # --- failure ----------------------------------------------------------------------------

    def rebuild(self, slots=None) -> None:
        """Recompute sequences' rows from their mirrors (default: every active one), which first
        take every round that went through."""
        self._known = None
        for slot in range(self.active) if slots is None else slots:
            mirror = self._fold(slot)
            manager = StateManager.from_mirror(self.lm, mirror, capacity=self.capacity,
                                               score_layers=self.attention_layers)
            saved = manager.tensors()
            self.kv.write(slot, saved["keys"], saved["values"])
            self.length[slot] = manager.rows_per_layer
            self._set_rows(slot, mirror)
            self._set_predicted(slot, mirror, manager._predicted)
            self._take_newest(slot, manager)
            self.rebuilds += 1


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
        """[active, layers, heads, capacity] float32: each row's attention share per recorded
        layer and query head. exp(logit − log-normaliser) is elementwise, so a row's share does
        not depend on how many other rows or sequences the product covered."""
        shares = []
        for layer in layers:
            query = self.queries[layer].float() * self.scaling  # [active, heads, d]
            keys = kv.keys[layer, :active]  # [active, kv, capacity, d]
            heads, kv_heads = query.shape[1], keys.shape[1]
            logits = (query.reshape(active, kv_heads, heads // kv_heads, -1) @ keys.transpose(-1, -2).float())
            logits = logits.reshape(active, heads, -1) + mask.float()[:, None]
            norm = self.norms.get(layer)
            norm = logits.logsumexp(dim=-1) if norm is None else norm.float()
            shares.append((logits - norm[..., None]).exp())
        return torch.stack(shares, dim=1)
