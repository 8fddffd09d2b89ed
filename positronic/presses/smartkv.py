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
from ..smartkv.rows import FLOOR
from .base import Plan, Press, Settings


@dataclass(frozen=True)
class SmartKVSettings(Settings):
    gates: str = ""  # a gate file; "": those shipped for the model
    memory_rank: str = "gates"  # gates | recent

    def __post_init__(self):
        super().__post_init__()
        if self.memory_rank not in MEMORY_RANKS:
            raise ValueError(f"memory_rank must be one of {', '.join(MEMORY_RANKS)}, got {self.memory_rank!r}")
        if not isinstance(self.gates, str):
            raise ValueError(f"gates must be a path or '', got {self.gates!r}")


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
        super().__init__(settings)
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
        rank = weight * (positions.double() - (position + s.window - self.horizon)[:, None, None]).clamp(
            min=FLOOR * self.horizon)
        if "used" in state:
            next["used"] = used = self._attend(rows, state["used"])
            rank = rank * (1.0 + used) ** BETA
        row = torch.arange(capacity, device=length.device)
        candidate = (row >= self.keep) & (row <= at[:, None])  # [S, N]: the memory and the leaving row
        lowest = torch.where(candidate[:, None], rank, math.inf).argmin(dim=2)  # [S, L]: the first, ties to the older
        deleted = torch.zeros((count, lanes, capacity), dtype=torch.bool, device=length.device).scatter(
            2, lowest[..., None], full[:, None, None].expand(-1, lanes, 1))
        return Plan(deleted, full.long(), rank, next, torch.zeros_like(full))

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
        take (pins, recall) or a state whose rows do not lie as it keeps them."""
        if policy.recall is not None or policy.pinned_out or any(mirror.ledger[i].pinned for i in mirror.live.ledger_ids):
            raise ValueError("smartkv with pinned rows or recall does not run on Core v4 yet")
        ids = np.array(mirror.layers.rows, dtype=np.int64)  # [lanes, rows], ledger ids ascending in each
        memory, keep, lanes, rows = policy.memory, self.keep, *ids.shape
        stored = keep + memory.count  # rows past it are not offered yet: the same tokens in every lane
        slots = np.argsort(memory.ids[:, : memory.count], axis=1)  # each lane's memory in row (ledger) order
        if (lanes != self.lanes or rows > self.settings.budget or memory.until[:, : memory.count].any()
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
        return carried | ({"used": torch.from_numpy(used)} if "used" in self.row_state else {})
