"""`smartkv`: SmartKV's memories (positronic/smartkv/policy.py, without recall) as a press over
lanes. A lane (a layer, or with per-head gates a kv head of a layer) keeps its own rows:

    rows 0 .. keep-1          max(sinks, protect) rows, in every lane for good
    then the memory           up to budget - keep - window rows, the lane's own
    the last `window` rows    the most recent tokens, in every lane (rows not offered yet)

Every lane holds as many rows, so the rows each lane keeps apart lie at the same row numbers in
every lane, and a sequence's length says where they are: the window's oldest row, n - window
(n the live rows), leaves the window in this round once it is past the kept rows. It is scored
then, for every sequence at once (its key in each layer un-rotated through that layer's gate,
plus log4 of its value norm in each lane), and competes with the lane's memory: once the memory
is full (n = budget) each lane drops the lowest rank among its memory and the leaving row,

    rank = 4 ** score · max(FLOOR · horizon, position − (now − horizon))   [· (1 + used) ** BETA]

now = the leaving row's position + window, ties to the lower row (the older token), exactly as
`Memories.offer` (rows.py) and `RecentMemories` (recent.py, `memory_rank` "recent": `used` the
decayed sum of the lane's largest head share, times its rows, after every forward).

Per-row lane state, [S, lanes, N] float64, moved with each lane's rows by the state: "weight",
4 ** score of a scored row (0: not scored yet; a score's power is never 0), and with "recent"
"used". A sequence joins with its policy's memories, scores and sums (`carry`).

Where it is not today's to the bit: the policy scores window tokens in batches of `window`
rows, read from its own cache; here a token is scored when it leaves, among the round's
leaving tokens, from the slots' K/V (equal in layer 0, within ~2e-5 deeper: another forward).
Scores then differ in the last bits (a matrix product's rows depend on how many it multiplies;
all of a window at once here gives today's scores exactly), which has not changed a decision in
the tests (tokens and every lane's rows equal over 60-100 rounds, per-layer and per-head gates,
both ranks). Past the model's position limit the state packs positions down: the press ranks
by the packed ones, today's memories keep those their tokens had when offered (their ages jump),
so the two part ways a few rounds after a pack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from ..smartkv.cache import KeyUnrotator, value_log_norms
from ..smartkv.gates import GateSet
from ..smartkv.policy import MEMORY_RANKS, SmartKVPolicy, load_gates
from ..smartkv.recent import BETA, DECAY
from ..smartkv.rows import FLOOR, HELD
from ..state.slots import Inserts
from .base import Plan, Press, Settings
from .recall import NEVER, LaneIndex


@dataclass(frozen=True)
class SmartKVSettings(Settings):
    gates: str = ""  # a gate file; "": those shipped for the model
    memory_rank: str = "gates"  # gates | recent
    recall: bool = False  # tokens lanes dropped come back when a lane looks for them (recall.py)

    def __post_init__(self):
        super().__post_init__()
        if self.memory_rank not in MEMORY_RANKS:
            raise ValueError(f"memory_rank must be one of {', '.join(MEMORY_RANKS)}, got {self.memory_rank!r}")
        if not isinstance(self.gates, str):
            raise ValueError(f"gates must be a path or '', got {self.gates!r}")
        if self.evict_every:
            raise ValueError("evict_every applies to the shared-row policies, not smartkv (it drops one memory row "
                             "per lane every tick)")


class StackedGates:
    """Every layer's gate (gates.py, `Gate`) as stacked tensors, so that one call scores a
    round's keys in all layers: keys [layers, n, in_dim] (pre-RoPE) -> float32 [layers, n, heads]."""

    def __init__(self, gates: GateSet, device):
        def stack(get) -> Tensor:
            return torch.stack([get(gate).detach().to(device, torch.float32) for gate in gates.gates])

        self.mean, self.scale = stack(lambda g: g.mean)[:, None], stack(lambda g: g.scale)[:, None]  # [layers, 1, in]
        depth = len(gates.gates[0].linear)
        self.weights = [stack(lambda g, k=k: g.linear[k].weight).transpose(1, 2) for k in range(depth)]  # [layers, in, out]
        self.biases = [stack(lambda g, k=k: g.linear[k].bias)[:, None] for k in range(depth)]  # [layers, 1, out]

    def __call__(self, keys: Tensor) -> Tensor:
        x = (keys.to(torch.float32) - self.mean) / self.scale
        for k, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(bias, x, weight)
            if k < len(self.weights) - 1:
                x = torch.nn.functional.gelu(x)
        return x


class SmartKVPress(Press):
    """See the module docstring. `bind(lm)` loads the gates (or takes the joining brain's)."""

    name = "smartkv"
    Settings = SmartKVSettings
    reads_keys = True

    def __init__(self, settings):
        settings = SmartKVSettings.of(settings)
        if settings.window is None:  # BrainConfig's default for smartkv
            settings = replace(settings, window=SmartKVPolicy.default_window(settings.budget))
        self.row_state = {"weight": (torch.float64, 0.0)}
        if settings.memory_rank == "recent":
            self.row_state["used"] = (torch.float64, 0.0)
            self.reads_lane_peaks = True
        if settings.recall:  # a row taken back ranks from its return ("born") and is held until "until"
            # "slot": a memory row's place in today's memory (-1: not in it), which breaks the ties
            # recall makes (rows taken back together share their age; every row held ranks alike)
            self.row_state |= {"born": (torch.float64, -1.0), "until": (torch.float64, 0.0),
                               "slot": (torch.float64, -1.0)}
            self.reads_query = True
        super().__init__(settings)
        self.index: LaneIndex | None = None
        self.keep = max(settings.sinks, settings.protect)
        self.gates: GateSet | None = None
        self._lm = self._stacked = None

    def check(self):
        """SmartKVPolicy.check's rules that concern a press: a window and a memory."""
        s = self.settings
        if s.window < 1:
            raise ValueError("policy smartkv needs a window of at least 1 row (the newest token)")
        if s.budget - max(s.sinks, s.protect) - s.window < 1:
            raise ValueError(f"policy smartkv: budget {s.budget} leaves no long-term memory after "
                             f"{max(s.sinks, s.protect)} kept rows and a window of {s.window}")

    def bind(self, lm, policy=None):
        if self._lm is lm:
            return
        share = isinstance(policy, SmartKVPolicy) and policy.config.gates == self.settings.gates
        self.gates = policy.gates if share else load_gates(self.settings.gates, lm)
        self.heads = self.gates.heads  # lanes per layer: 1, or the kv heads (per-head gates)
        self.horizon = self.gates.horizon
        self.lanes = lm.num_layers * self.heads
        self.unrotate = KeyUnrotator(lm.inv_freq)
        self._lm, self._stacked = lm, None
        if self.settings.recall:
            size = SmartKVPolicy.memory_size(self.settings)
            self.index = LaneIndex(lm, lanes=self.lanes, heads=self.heads, size=size, share=SmartKVPolicy.recall_share,
                                   span=SmartKVPolicy.recall_span(size), hold=SmartKVPolicy.recall_hold,
                                   capacity=SmartKVPolicy.recall_capacity)
            self.slot_state = self.index.declarations()

    # --- a round ------------------------------------------------------------------------------

    def plan(self, rows, state, clock, need=None) -> Plan:
        """One round for S sequences: each offers its leaving row to every lane's memory and, once
        that is full, drops one row per lane (`need` is not taken: a prompt is pruned by its
        Brain before it joins). deleted, values (the ranks) [S, lanes, N]."""
        s, length, positions = self.settings, rows.length, rows.lane_positions  # [S], [S, L, N]
        count, lanes, capacity = positions.shape
        at = (length - s.window).clamp(min=0)  # [S]: the row leaving the window, the same in every lane
        offers = length - s.window >= self.keep
        full = offers & (length >= s.budget)  # the memory is full: each lane drops one row
        position = positions[:, 0].gather(1, at[:, None])[:, 0]  # [S]
        weight = self._weigh(rows, state["weight"], torch.where(offers, at, -1))
        next = {"weight": weight}
        born = positions.double()  # what a row's age counts from: its position, or its return (recall)
        if "born" in state:
            born = torch.where(state["born"] >= 0, state["born"], born)
        if "used" in state:
            next["used"] = used = self._attend(rows, state["used"])

        def ranks(now: Tensor) -> Tensor:  # [S, L, N] at step now [S]
            rank = weight * (born - (now - self.horizon)[:, None, None]).clamp(min=FLOOR * self.horizon)
            if "used" in state:
                rank = rank * (1.0 + used) ** BETA
            return rank if self.index is None else self.index.held(rank, state["until"], now)

        rank = ranks(position + s.window)
        row = torch.arange(capacity, device=length.device)
        candidate = (row >= self.keep) & (row <= at[:, None])  # [S, N]: the memory and the leaving row
        masked = torch.where(candidate[:, None], rank, math.inf)
        ties = masked == masked.amin(dim=2, keepdim=True)
        if "slot" in state:  # ties to the older, then the lower slot; the leaving row's after all (`Memories.offer`)
            slot = torch.where((row == at[:, None])[:, None], float(SmartKVPolicy.memory_size(s)), state["slot"])
            oldest = ties & (born == torch.where(ties, born, math.inf).amin(dim=2, keepdim=True))
            lowest = torch.where(oldest, slot, math.inf).argmin(dim=2)
            next["slot"] = self._slotted(state["slot"], lowest, at, offers, full)
        else:
            lowest = torch.where(ties, born, math.inf).argmin(dim=2)  # [S, L]: ties to the older (then the lower row)
        deleted = torch.zeros((count, lanes, capacity), dtype=torch.bool, device=length.device).scatter(
            2, lowest[..., None], full[:, None, None].expand(-1, lanes, 1))
        plan = Plan(deleted, full.long(), rank, next, torch.zeros_like(full))
        return plan if self.index is None else self._recall(rows, state, plan, ranks, born, candidate, offers, at)

    def _slotted(self, slot: Tensor, lowest: Tensor, at: Tensor, offers: Tensor, full: Tensor) -> Tensor:
        """slot [S, L, N] with the leaving row's place in each lane's memory: the next free one
        while the memory fills (its rows so far), then the place of the row it replaces."""
        slot = slot.clone()
        members = offers.nonzero()[:, 0]
        freed = slot.gather(2, lowest[..., None])[..., 0]  # [S, L]
        place = torch.where(full[:, None], freed, (at - self.keep).double()[:, None])
        slot[members, :, at[members]] = place[members]
        return slot

    def _recall(self, rows, state, plan: Plan, ranks, born: Tensor, candidate: Tensor, offers: Tensor, at: Tensor) -> Plan:
        """Recall's part of the round (recall.py): the lookup where the memories are full, each
        lane taking tokens back dropping as many of its weakest memory rows (after the offer),
        the rows coming back, and the index's next state with the window-leavers' K/V."""
        s, index, length, positions = self.settings, self.index, rows.length, rows.lane_positions
        count, lanes, capacity = positions.shape
        device, ring = length.device, index.capacity
        row = torch.arange(capacity, device=device)
        newest = positions[:, 0].gather(1, (length - 1).clamp(min=0)[:, None])[:, 0]
        now = newest + 1  # the new token's position: where a token's return counts from
        stored = state["recall.count"]
        filled = torch.arange(ring, device=device) < stored[:, None]
        looking = offers & (length >= s.budget - 1)  # the memories are full once this round's token is offered
        # the positions were packed since the index was filled: its keys are stale, it starts again
        forget = looking & (newest <= torch.where(filled, state["recall.positions"], -1).amax(dim=1))
        clock = state["recall.clock"] + looking.long()
        lane_rows = torch.where(row < length[:, None, None], positions, torch.iinfo(torch.long).max)
        looks = looking & ~forget & (now < index.max_positions)  # no return in a round that packs
        taking, near = index.look(rows, state, looks, lane_rows, clock)  # [S, L, ring], [S, ring]
        slot = plan.next["slot"]
        back = taking.any(dim=1)  # [S, ring]: the tokens coming back into some lane
        deleted, inserts = plan.deleted, None
        next = dict(plan.next) | {"born": state["born"], "until": state["until"]}  # rows kept keep theirs
        if (width := int(back.sum(dim=1).max())) > 0:  # most rounds take nothing back: no ranking, no sorts
            weakest, weak = index.weakest(ranks(now), slot, candidate[:, None] & ~plan.deleted, taking.sum(dim=2))
            deleted = plan.deleted | weakest
            slots = torch.sort((~back).to(torch.int8), dim=1, stable=True).indices[:, :width]  # [S, J]
            taken = taking.gather(2, slots[:, None].expand(-1, lanes, -1)) & back.gather(1, slots)[:, None]
            members = torch.arange(count, device=device)[:, None]
            when = now.double()[:, None, None].expand(-1, lanes, width)
            row_state = {"weight": state["recall.weights"].gather(1, slots[..., None].expand(-1, -1, lanes)).transpose(1, 2),
                         "born": when, "until": when + index.hold}
            row_state |= {"used": torch.zeros_like(when)} if "used" in next else {}
            # a lane's returns, in the order they come back, take the places of its weakest rows in turn
            along = near[:, None].expand(-1, lanes, -1)
            turn = torch.zeros_like(along).scatter_(2, along, taking.gather(2, along).long().cumsum(dim=2) - 1)
            row_state["slot"] = slot.gather(2, weak).gather(2, turn.gather(2, slots[:, None].expand(-1, lanes, -1))
                                                            .clamp(min=0))
            inserts = Inserts(taken, state["recall.positions"].gather(1, slots), state["recall.tokens"].gather(1, slots),
                              state["recall.keys"][members, :, :, slots], state["recall.values"][members, :, :, slots],
                              row_state)
        start, stored = torch.where(forget, 0, state["recall.next"]), torch.where(forget, 0, stored)
        # the tokens leaving the window (every lane holds them) join the index, in the ring's next slots
        offered = state["recall.offered"]
        leaving = (offers[:, None] & (row >= self.keep) & (row <= at[:, None])
                   & (positions[:, 0] > offered[:, None]))  # [S, N]
        joining = leaving.sum(dim=1)
        slot_of = (start[:, None] + leaving.long().cumsum(dim=1) - 1) % ring
        members, where = leaving.nonzero(as_tuple=True)
        items = slot_of[members, where]
        keys, values = rows.read(members, where)  # [M, layers, kv_heads, head_dim]
        # The index changes in a few ring slots a round, written in place once the round is adopted
        # (a new [S, ring, lanes] tensor a round cost more than the rest of recall): a joining
        # token's slot (not back since: NEVER), the slots taken back (this clock, in the lanes that
        # took them), and every slot of a sequence that forgets (NEVER).
        joined = torch.zeros_like(back)
        joined[members, items] = True
        who, which = (back | joined | forget[:, None]).nonzero(as_tuple=True)
        back_at = torch.where(taking[who, :, which], clock[who, None], state["recall.back_at"][who, which])
        back_at = torch.where((joined[who, which] | forget[who])[:, None], NEVER, back_at)  # [n, lanes]
        writes = {"recall.keys": (members, items, keys, 3), "recall.values": (members, items, values, 3),
                  "recall.positions": (members, items, positions[members, 0, where], 1),
                  "recall.tokens": (members, items, rows.token_ids[members, where], 1),
                  "recall.weights": (members, items, next["weight"][members, :, where], 1),
                  "recall.back_at": (who, which, back_at, 1)}
        next |= {"recall.count": (stored + joining).clamp(max=ring), "recall.next": (start + joining) % ring,
                 "recall.clock": clock, "recall.restored": state["recall.restored"] + back.sum(dim=1),
                 "recall.offered": torch.where(offers, torch.maximum(offered, positions[:, 0].gather(1, at[:, None])[:, 0]),
                                               offered)}
        return Plan(deleted, plan.need, plan.values, next, plan.stop, inserts, writes)

    def _weigh(self, rows, weight: Tensor, at: Tensor) -> Tensor:
        """weight [S, L, N] with every row up to the leaving one scored: the leaving row, and
        after a join from a short prompt the rows today's policy offers in one go on its first
        tick (a row scored before joining keeps its weight)."""
        row = torch.arange(weight.shape[2], device=at.device)
        unscored = (row >= self.keep) & (row <= at[:, None]) & (weight[:, 0] == 0)  # [S, N]
        members, where = unscored.nonzero(as_tuple=True)  # [M] each: one a round per offering sequence
        if not len(members):
            return weight
        keys, values = rows.read(members, where)  # [M, layers, kv_heads, head_dim]
        position = rows.lane_positions[members, 0, where]  # [M]: the same in every lane
        weight = weight.clone()
        weight[members, :, where] = torch.pow(4.0, self._scores(keys, values, position).double())
        return weight

    def _scores(self, keys: Tensor, values: Tensor, position: Tensor) -> Tensor:
        """float32 [M, lanes] (layer-major, as the state numbers lanes): each layer's gate on the
        keys [M, layers, kv_heads, head_dim] un-rotated from `position` [M], plus log4 of the
        value norms, as `SmartKVPolicy._score` scores, all layers at once."""
        count, layers, kv_heads, head_dim = keys.shape
        if self._stacked is None:
            self._stacked = StackedGates(self.gates, keys.device)
        # every layer's rows side by side in one [1, kv_heads, layers * M, head_dim] set of rows
        plain = self.unrotate(keys.permute(2, 1, 0, 3).reshape(1, kv_heads, layers * count, head_dim),
                              position.repeat(layers))  # [layers * M, kv_heads * head_dim]
        scores = self._stacked(plain.reshape(layers, count, -1))  # [layers, M, heads]
        norms = value_log_norms(values.permute(2, 1, 0, 3).reshape(kv_heads, layers * count, head_dim), self.heads)
        scores = scores + norms.reshape(layers, count, -1)
        return scores.transpose(0, 1).reshape(count, layers * self.heads)

    @staticmethod
    def _attend(rows, used: Tensor) -> Tensor:
        """`RecentMemories.attend` for every row: the sums decay, then gain the newest query's
        share (the lane's largest head share, times the live rows: 1 is uniform). A sequence
        whose forward recorded none (every share 0: each head gives some row >= 1/rows) counts
        nothing this round, as the policy does without a query."""
        peaks = rows.lane_peaks  # [S, L, N] float32
        share = (peaks * rows.length[:, None, None]).double()
        recorded = peaks.amax(dim=(1, 2)) > 0
        return torch.where(recorded[:, None, None], DECAY * used + share, used)

    # --- a joining sequence -----------------------------------------------------------------------

    def carry(self, policy: SmartKVPolicy, mirror) -> dict[str, Tensor]:
        """The per-row lane state [lanes, rows] of a brain's SmartKVPolicy: its memories' weights
        (and recent-use sums) at the rows that hold them; for the tokens it has not offered yet
        (the window, and after a short prompt those its first tick offers in one go), the
        scores it already has and the window's sums. ValueError for what this press cannot
        take (pins) or a state whose rows do not lie as it keeps them. With recall: where each
        memory row's age counts from and until when it is held (a token taken back)."""
        if policy.pinned_out or any(mirror.ledger[i].pinned for i in mirror.live.ledger_ids):
            raise ValueError("smartkv with pinned rows does not run on Core v4 yet")
        if (policy.recall is not None) != self.settings.recall:
            raise ValueError("the smartkv policy's recall and the press's differ")
        ids = np.array(mirror.layers.rows, dtype=np.int64)  # [lanes, rows], ledger ids ascending in each
        memory, keep, lanes, rows = policy.memory, self.keep, *ids.shape
        stored = keep + memory.count  # rows past it are not offered yet: the same tokens in every lane
        slots = np.argsort(memory.ids[:, : memory.count], axis=1)  # each lane's memory in row (ledger) order
        if (lanes != self.lanes or rows > self.settings.budget or (memory.until[:, : memory.count].any() and not self.settings.recall)
                or (ids[:, keep:stored] != np.take_along_axis(memory.ids[:, : memory.count], slots, axis=1)).any()
                or (ids[:, stored:] <= policy.offered).any() or (ids[:, stored:] != ids[0, stored:]).any()):
            raise ValueError("the smartkv policy's memories do not lie as the press keeps them (kept rows, "
                             "memory, then the tokens not offered yet)")
        weight, used = np.zeros((lanes, rows)), np.zeros((lanes, rows))
        weight[:, keep:stored] = np.take_along_axis(memory.weights[:, : memory.count], slots, axis=1)
        for row in range(stored, rows):  # some scored already, in today's batches: kept bit for bit
            if (scores := policy.scores.get(int(ids[0, row]))) is not None:
                weight[:, row] = [4.0 ** float(score) for score in scores]  # as `Memories.offer` weighs them
        if memory.watches:  # the recent-use sums (recent.py)
            used[:, keep:stored] = np.take_along_axis(memory.used[:, : memory.count], slots, axis=1)
            column = {int(i): k for k, i in enumerate(memory.window_ids)}
            for row in range(stored, rows):
                if (k := column.get(int(ids[0, row]))) is not None:
                    used[:, row] = memory.window_used[:, k]
        carried = {"weight": torch.from_numpy(weight)}
        if self.settings.recall:
            born, until = np.full((lanes, rows), -1.0), np.zeros((lanes, rows))
            born[:, keep:stored] = np.take_along_axis(memory.positions[:, : memory.count], slots, axis=1)
            until[:, keep:stored] = np.take_along_axis(memory.until[:, : memory.count], slots, axis=1)
            place = np.full((lanes, rows), -1.0)
            place[:, keep:stored] = slots  # the memory slot of each of its rows
            carried |= {"born": torch.from_numpy(born), "until": torch.from_numpy(until), "slot": torch.from_numpy(place)}
        return carried | ({"used": torch.from_numpy(used)} if "used" in self.row_state else {})

    def restore(self, policy: SmartKVPolicy, mirror, rows: dict[str, Tensor], slots: dict[str, Tensor]) -> bool:
        """`carry` backwards, for a sequence leaving into its Brain: `policy`'s memories are each
        lane's rows past the kept ones and before the `window` newest (not offered yet), in row
        order, with their weights (scores: log4 of them), ages (`born`), holds and recent-use
        sums; the window's sums and any scores it carried; `offered`, the token before the
        window; recall's index (`LaneIndex.restore`). Each lane's memory rows go into the slots
        today's memory keeps them in (`slot`, kept with recall, whose returns make the ties a
        slot breaks; row order without). Not kept: the predictions of the indexed tokens (what the
        live view shows of a token taken back)."""
        ids = np.array(mirror.layers.rows, dtype=np.int64)  # [lanes, n], ledger ids ascending in each
        lanes, n = ids.shape
        keep = self.keep
        unoffered = min(self.settings.window, max(n - keep, 0))  # the window's tokens: the same in every lane
        count = max(n - keep - unoffered, 0)
        held, window = slice(keep, keep + count), slice(n - unoffered, n)
        weight = rows["weight"].numpy()
        live = np.array(mirror.live.ledger_ids, dtype=np.int64)  # every lane's rows are among them
        order = np.argsort(live, kind="stable")
        born = np.array(mirror.live.positions, dtype=np.float64)[order[np.searchsorted(live[order], ids)]]
        if "born" in rows:  # a token taken back ages from its return
            born = np.where(rows["born"].numpy() >= 0, rows["born"].numpy(), born)
        memory = type(policy.memory)(lanes, policy.size, policy.horizon)
        memory.count = count
        # each lane's memory rows in the slots today's memory keeps them in (row order without recall)
        place = (rows["slot"].numpy()[:, held].astype(np.int64) if "slot" in rows
                 else np.broadcast_to(np.arange(count), (lanes, count)))
        lane = np.arange(lanes)[:, None]
        memory.ids[lane, place], memory.weights[lane, place] = ids[:, held], weight[:, held]
        memory.scores[lane, place] = np.log(weight[:, held]) / math.log(4.0)
        memory.positions[lane, place] = born[:, held]
        if "until" in rows:
            memory.until[lane, place] = rows["until"].numpy()[:, held]
        if memory.watches:
            used = rows["used"].numpy()
            memory.used[lane, place] = used[:, held]
            memory.window_ids, memory.window_used = ids[0, window].copy(), used[:, window].copy()
        scored = weight[0, window] > 0  # window tokens scored before they joined, kept as they were
        policy.memory, policy.pinned_out = memory, frozenset()
        policy.offered = int(ids[0, n - unoffered]) - 1 if count else -1
        policy.scores = {int(i): (np.log(weight[:, window][:, k]) / math.log(4.0)).tolist()
                         for k, i in enumerate(ids[0, window]) if scored[k]}
        if self.index is not None:
            self.index.restore(policy.recall, mirror, {name.removeprefix("recall."): value
                                                       for name, value in slots.items()})
        return True

    def carry_slots(self, policy: SmartKVPolicy, mirror) -> dict[str, Tensor]:
        """Recall's index, as today's policy keeps it (recall.py, `LaneIndex.carry`)."""
        return {} if self.index is None else self.index.carry(policy.recall, policy.offered, mirror)
