"""Recall for the `smartkv` press: tokens lanes dropped come back into the lanes that look for
them, for every sequence at once (today's `positronic/smartkv/recall.py`, `LaneRecall`).

Per sequence the state keeps a ring of the K/V of the tokens that left the window (every lane
held them then), as per-sequence tensors of the slot state (`SlotState.declare_sequence`):

    keys, values  [layers, kv_heads, capacity, head_dim]   the cache's dtype
    positions, tokens [capacity] int64; weights [capacity, lanes] float64 (4 ** the token's
    score in each lane, what its rank starts from when it comes back); back_at [capacity,
    lanes] int64 (the clock of its last return into each lane, NEVER: none)
    count, next, clock, offered, restored [] int64 (filled slots, the next slot to write, the
    rounds recall looked, the newest offered position, tokens brought back)

A round (`look`), where a sequence's memories are full: the newest query of every layer
against every indexed key of every sequence in one batched product, exp(q·k − log-normaliser)
averaged over each lane's query heads; the best token some lane lacks comes back if that lane
would give it `share` of the attention it gives its own rows, with the indexed tokens nearest
to it in position (`span`, ordered by `reach` then position: the text after it first), into
every lane that lacks each, at most `room` per lane in that order, none into a lane that took
it back less than `cooldown` looks ago. A lane drops as many of its weakest memory rows (after
the round's offer); a token back is held for `hold` rounds and ranks from its return on (`born`).

The selection is `LaneRecall.look_lanes` + `Memories.take_back` as masks over [S, lanes,
index] and one stable sort of ranks; the only differences from today are last-bit ones in the
product (another forward's query), where a share on the threshold could decide otherwise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..policies.recall import DEFAULT_COOLDOWN
from ..smartkv.recall import reach
from ..smartkv.rows import HELD

NEVER = -(2**40)  # back_at of a token never brought back into a lane


class LaneIndex:
    """Recall's settings and its batched steps for a smartkv press of `lanes` lanes (`heads`
    per layer) whose memories hold `size` rows; see the module docstring."""

    def __init__(self, lm, *, lanes: int, heads: int, size: int, share: float, span: int, hold: int,
                 capacity: int, cooldown: int = DEFAULT_COOLDOWN):
        self.lanes, self.heads, self.share, self.span, self.hold = lanes, heads, share, span, hold
        self.cooldown, self.capacity, self.room = cooldown, capacity, max(1, size // 2)
        self.layers, self.kv_heads, self.head_dim = lm.num_layers, lm.num_kv_heads, lm.head_dim
        self.dtype, self.max_positions = lm.dtype, lm.max_positions

    def declarations(self) -> dict[str, tuple[tuple[int, ...], torch.dtype, float]]:
        """name -> (shape, dtype, fill) of the per-sequence tensors."""
        ring, kv = self.capacity, (self.layers, self.kv_heads, self.capacity, self.head_dim)
        return {"recall.keys": (kv, self.dtype, 0.0), "recall.values": (kv, self.dtype, 0.0),
                "recall.positions": ((ring,), torch.long, 0), "recall.tokens": ((ring,), torch.long, 0),
                "recall.weights": ((ring, self.lanes), torch.float64, 0.0),
                "recall.back_at": ((ring, self.lanes), torch.long, NEVER),
                **{f"recall.{name}": ((), torch.long, -1 if name == "offered" else 0)
                   for name in ("count", "next", "clock", "offered", "restored")}}

    # --- a joining sequence -----------------------------------------------------------------------

    def carry(self, recall, offered: int, mirror) -> dict[str, Tensor]:
        """The per-sequence tensors of today's `LaneRecall` (its ring as it lies, slot for slot)
        and the newest offered token's position (`offered`: its ledger id, -1 none)."""
        if recall.capacity != self.capacity or recall.cooldown != self.cooldown or recall.every != 1:
            raise ValueError("the recall index's capacity, cooldown or schedule differ from the press's")
        n, state = len(recall.ids), {}
        # the filled slots only (the state keeps the rest at its fill): the ring is ~188 MB for SmolLM2
        keys = values = torch.zeros(self.layers, self.kv_heads, 0, self.head_dim, dtype=self.dtype)
        if n:
            keys = recall.keys[..., :n].transpose(2, 3).to(self.dtype)
            values = recall.values[:, :, :n].to(self.dtype)
        positions, tokens = torch.zeros(self.capacity, dtype=torch.long), torch.zeros(self.capacity, dtype=torch.long)
        weights = torch.zeros(self.capacity, self.lanes, dtype=torch.float64)
        back_at = torch.full((self.capacity, self.lanes), NEVER, dtype=torch.long)
        if n:
            positions[:n] = torch.tensor(recall.positions[:n], dtype=torch.long)
            tokens[:n] = torch.tensor([mirror.ledger[ledger_id].token_id for ledger_id in recall.ids], dtype=torch.long)
            weights[:n] = torch.tensor([[4.0 ** float(score) for score in recall.scores[ledger_id]]
                                        for ledger_id in recall.ids], dtype=torch.float64)
        where = {ledger_id: slot for slot, ledger_id in enumerate(recall.ids)}
        for (ledger_id, lane), clock in recall.lane_back_at.items():
            if ledger_id in where:
                back_at[where[ledger_id], lane] = clock
        # every row past the last offered token (the window, not offered yet) is newer than it
        where = dict(zip(mirror.live.ledger_ids, mirror.live.positions))
        later = [where[i] for i in mirror.layers.rows[0] if i > offered]
        position = -1 if offered < 0 else (min(later) - 1 if later else max(where.values()))
        state |= {"keys": keys, "values": values, "positions": positions, "tokens": tokens, "weights": weights,
                  "back_at": back_at}
        state |= {name: torch.tensor(value) for name, value in (
            ("count", n), ("next", recall.next), ("clock", recall.clock), ("offered", position),
            ("restored", recall.restored))}
        return {f"recall.{name}": value for name, value in state.items()}

    def restore(self, recall, mirror, index: dict[str, Tensor]) -> None:
        """`carry` backwards: today's `LaneRecall` takes the ring as the press left it, slot for
        slot (its tokens' ledger ids found by position and token in `mirror`), with each token's
        scores per lane (log4 of its weights), the lanes' last returns and the clocks. The
        press keeps no predictions of indexed tokens: they come back as 0."""
        n, ring = int(index["count"]), self.capacity
        places = {}
        live = dict(zip(mirror.live.ledger_ids, mirror.live.positions))
        for ledger_id, entry in enumerate(mirror.ledger.entries):
            position = live.get(ledger_id, entry.position)
            if position is not None:
                places[(position, entry.token_id)] = ledger_id
        positions, tokens = index["positions"][:n].tolist(), index["tokens"][:n].tolist()
        ids = [places[place] for place in zip(positions, tokens)]
        keys = values = None
        if n:
            keys, values = (index[name][:, :, :n].float() for name in ("keys", "values"))
        recall._set_rows(ids, positions, [0] * n, keys, values)
        recall.next = int(index["next"]) % ring if n else 0
        weights = index["weights"][:n]
        recall.scores = {i: (torch.log(w) / math.log(4.0)).tolist() for i, w in zip(ids, weights)}
        back_at = index["back_at"][:n]
        recall.lane_back_at = {(ids[slot], lane): int(back_at[slot, lane])
                               for slot, lane in (back_at != NEVER).nonzero().tolist()}
        recall.back_at, recall.awake = {}, False
        recall.clock, recall.restored = int(index["clock"]), int(index["restored"])

    # --- a round ---------------------------------------------------------------------------------

    def look(self, rows, index: dict[str, Tensor], looks: Tensor, held_positions: Tensor,
             clock: Tensor) -> tuple[Tensor, Tensor]:
        """bool [S, lanes, capacity]: the indexed tokens each lane takes back this round, and
        int64 [S, capacity]: the ring's slots in the order they come back (nearest the match first,
        as today's lookup lists them; slots past the filled ones last).
        looks [S] bool: sequences whose memories are full (and whose positions were not packed);
        held_positions [S, lanes, N] int64: each lane's rows' positions (a large value past the
        rows), ascending; clock [S]: this round's clock (the looks so far, this one included)."""
        count = index["recall.count"]
        S, ring = count.shape[0], self.capacity
        none = torch.zeros((S, self.lanes, ring), dtype=torch.bool, device=count.device)
        in_ring = torch.arange(ring, device=count.device).expand(S, -1)
        looks = looks & (count > 0)
        if not bool(looks.any()):
            return none, in_ring
        filled = torch.arange(ring, device=count.device) < count[:, None]  # [S, ring]
        used = int(count.max())  # slots past every sequence's count hold nothing
        keys = index["recall.keys"][..., :used, :]  # [S, layers, kv_heads, used, head_dim]
        query = rows.query.reshape(S, self.layers, self.kv_heads, -1, self.head_dim)
        logits = query @ keys.transpose(-1, -2).float()  # [S, layers, kv_heads, group, used]: one product
        logits = logits - rows.log_norm.reshape(S, self.layers, self.kv_heads, -1, 1)
        shares = logits.exp()
        shares = shares.mean(dim=(2, 3)) if self.heads == 1 else shares.mean(dim=3).reshape(S, self.lanes, used)
        positions = index["recall.positions"][:, :used]
        # a lane lacks a token when none of its rows (before the round) holds its position
        at = torch.searchsorted(held_positions, positions[:, None].expand(-1, self.lanes, -1).contiguous())
        found = held_positions.gather(2, at.clamp(max=held_positions.shape[2] - 1)) == positions[:, None]
        missing = ~found & filled[:, None, :used] & looks[:, None, None]
        lost = (shares * missing).amax(dim=1)  # [S, used]
        best = lost.argmax(dim=1)  # the first of equals, in ring order as today
        wanted = lost.gather(1, best[:, None])[:, 0] >= self.share
        # the tokens nearest the match (`reach`: the text after it first), then by position, within `span`
        distance = reach(positions - positions.gather(1, best[:, None]))
        key = torch.where(filled[:, :used], distance * (self.max_positions + 1) + positions, torch.iinfo(torch.long).max)
        order = key.argsort(dim=1)  # positions differ, so the order is total
        ranked = torch.empty_like(order).scatter_(1, order, torch.arange(used, device=order.device).expand(S, -1))
        near = filled[:, :used] & (distance <= self.span) & (ranked < self.span) & wanted[:, None]
        back_at = index["recall.back_at"][:, :used].transpose(1, 2)  # [S, lanes, used]
        cooled = clock[:, None, None] - back_at >= self.cooldown
        eligible = near[:, None] & missing & cooled
        # each lane takes them in that order while it has room
        lined = eligible.gather(2, order[:, None].expand(-1, self.lanes, -1))
        taking = lined & (lined.cumsum(dim=2) <= self.room)
        none[..., :used] = torch.zeros_like(taking).scatter_(2, order[:, None].expand(-1, self.lanes, -1), taking)
        return none, torch.cat([order, in_ring[:, used:]], dim=1)

    @staticmethod
    def weakest(rank: Tensor, slot: Tensor, candidate: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
        """bool [S, lanes, N]: the `count` [S, lanes] lowest-ranked `candidate` rows of each lane,
        ties to the lower memory `slot` [S, lanes, N] (today's memory takes the first slot of
        equal ranks: `Memories.take_back`); and int64 [S, lanes, N], the rows in that order."""
        row = torch.arange(rank.shape[2], device=rank.device)
        by_slot = torch.sort(torch.where(candidate, slot, math.inf), dim=2, stable=True).indices
        ranks = torch.where(candidate, rank, math.inf).gather(2, by_slot)
        order = by_slot.gather(2, torch.sort(ranks, dim=2, stable=True).indices)
        chosen = row < count[..., None]
        return torch.zeros_like(candidate).scatter_(2, order, chosen) & candidate, order

    def held(self, rank: Tensor, until: Tensor, now: Tensor) -> Tensor:
        """`rank` with rows held (until > now) at HELD, as `Memories._ranks`."""
        return torch.where(until > now[:, None, None], HELD, rank)
