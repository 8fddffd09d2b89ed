"""Recall under SmartKV: a token a lane dropped comes back into the lanes that look for it.

The shared-rows recall (positronic/policies/recall.py) keeps a row's K/V when the row is
evicted. Under SmartKV a token leaves lanes one by one, each when its own memory prefers
another, so the index copies a token's K/V in every lane at the one moment every lane holds
it: when it leaves the window (`capture`). From then on it can come back into any lane that
dropped it, exactly as it was (keys rotated at its position, which is where it comes back).

When: as the shared recall (every `every` ticks, at once after typed input), the newest
token's query scores the indexed keys in each lane: a lane's would-be attention to a token
is exp(q·k - log Σ_lane exp(q·k')), averaged over the query heads of the lane (a kv head's
group, or all heads of a layer). A lane *wants* a token it does not hold when that share is
at least `threshold` times its fair share (1 / rows per lane). The best such token comes
back into the lanes that want it, with up to `span` indexed tokens nearest to it (the text
around a match is what makes it useful), into those same lanes where they are missing; each
lane then drops as many of its weakest memory rows, so every lane keeps the same count.

A token taken back starts a fresh lifespan in the lanes that took it (its rank's age is
counted from now: the query just showed it is in use), so the next offer does not push it
out again at once; `cooldown` ticks keep it from coming back again soon after.

    keys, values  [layers, kv_heads, rows, head_dim]  (float32, on the CPU)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..policies.recall import Lookup, Recall


@dataclass
class LaneLookup(Lookup):
    """A Lookup that also says which lanes take each token back (ledger id -> lanes)."""

    lanes: dict[int, list[int]] = field(default_factory=dict)
    forget: bool = False  # the positions were packed since the index was filled: its keys are stale


class LaneRecall(Recall):
    """The index of window-leavers' K/V and the per-lane lookup (see the module docstring).
    `scores`: each indexed token's gate score per lane (what its rank starts from when it
    comes back)."""

    def __init__(self, heads: int, **settings):
        super().__init__(**settings)
        self.heads = heads  # lanes per layer: 1, or the kv heads
        self.scores: dict[int, list[float]] = {}

    def idle(self) -> LaneLookup:
        return LaneLookup(self.clock, self.awake)

    def capture(self, lookup: Lookup, view, ledger_ids: list[int], scores: dict[int, list[float]]) -> None:
        """Copy the K/V of `ledger_ids` (leaving the window now, so every lane holds them)
        into the lookup; they join the index when the tick goes through (`adopt`)."""
        if not ledger_ids:
            return
        keys, values = view.rows.layer_rows(ledger_ids)  # [layers, kv_heads, n, head_dim], float32
        where = {int(i): row for row, i in enumerate(view.ledger_ids.tolist())}
        lookup.evicted = (list(ledger_ids), [int(view.positions[where[i]]) for i in ledger_ids],
                          [int(view.predicted[where[i]]) for i in ledger_ids], keys, values,
                          {i: list(scores[i]) for i in ledger_ids})

    def lane_shares(self, query: torch.Tensor, log_norm: torch.Tensor) -> torch.Tensor:
        """[lanes, rows] float32: each indexed token's would-be attention in each lane.
        query: [layers, heads, head_dim] (scaled, rotated); log_norm: [layers, heads]."""
        layers, kv_heads, _, head_dim = self.keys.shape
        if query.shape[0] != layers:
            raise ValueError(f"recall scores every layer's keys: the query covers {query.shape[0]} of {layers} layers")
        group = query.shape[1] // kv_heads
        grouped = query.reshape(layers, kv_heads, group, head_dim).to(self.keys.dtype)
        logits = (self.keys @ grouped.transpose(-1, -2)).float()  # [layers, kv_heads, rows, group]
        shares = (logits - log_norm.reshape(layers, kv_heads, 1, group)).exp()
        if self.heads == 1:  # a lane is a layer: every head of it
            return shares.mean(dim=(1, 3))
        return shares.mean(dim=3).reshape(layers * kv_heads, -1)

    def look_lanes(self, view, held: list[set[int]], rows: int, room: int, *, typed: bool = False) -> Lookup:
        """This tick's lookup: `back` (ledger ids, nearest to the best match first) and
        `lanes` (ledger id -> the lanes taking it back). held[l]: the ids lane l holds after
        this tick's drops; rows: rows per lane (a fair share is 1 / rows); room: tokens a lane
        may take back at once (each replaces one of its memory's)."""
        lookup = LaneLookup(self.clock + 1, typed)
        if self.positions and int(view.positions[-1]) <= max(self.positions):
            # the state packed its positions (past the model's limit): indexed keys are rotated
            # at positions the tokens no longer hold, so the index starts again
            lookup.forget = True
            return lookup
        due = self.awake or lookup.clock % self.every == 0
        if not due or not self.ids or view.query is None or view.log_norm is None:
            return lookup
        shares = self.lane_shares(view.query, view.log_norm)  # [lanes, index rows]
        index = {ledger_id: k for k, ledger_id in enumerate(self.ids)}
        missing = torch.ones_like(shares, dtype=torch.bool)
        for lane, ids in enumerate(held):
            found = [index[i] for i in ids if i in index]
            if found:
                missing[lane, found] = False
        wanted = (shares * rows >= self.threshold) & missing
        if not bool(wanted.any()):
            return lookup
        best = int(shares.masked_fill(~wanted, -1.0).amax(dim=0).argmax())
        lanes = wanted[:, best].nonzero().flatten().tolist()
        center = self.positions[best]
        near = sorted((abs(p - center), p, i) for i, p in zip(self.ids, self.positions)
                      if abs(p - center) <= self.span
                      and lookup.clock - self.back_at.get(i, -self.cooldown) >= self.cooldown)
        taken = dict.fromkeys(lanes, 0)
        for _, _, ledger_id in near[: self.span]:
            taking = [lane for lane in lanes if ledger_id not in held[lane] and taken[lane] < room]
            for lane in taking:
                taken[lane] += 1
            if taking:
                lookup.back.append(ledger_id)
                lookup.lanes[ledger_id] = taking
        return lookup

    def restore_action(self, lookup: Lookup) -> dict:
        """The restore action for `lookup.back` (their own K/V, the lanes taking each back)."""
        return {"action": "restore", "ledger_ids": list(lookup.back),
                "lanes": [list(lookup.lanes[i]) for i in lookup.back], **self.payload(lookup.back)}

    def adopt(self, lookup: Lookup) -> None:
        """The tick went through: its clocks stand, the tokens it brought back start their
        cooldown (they stay indexed: other lanes may still want them), the tokens that left
        the window join the index (the oldest go beyond `capacity`)."""
        self.clock, self.awake = lookup.clock, lookup.awake
        if getattr(lookup, "forget", False):
            self.ids, self.positions, self.predicted, self.keys, self.values = [], [], [], None, None
            self.scores, self.back_at = {}, {}
        if lookup.back:
            self.back_at.update((i, self.clock) for i in lookup.back)
            self.restored += len(lookup.back)
        if lookup.evicted:
            ids, positions, predicted, keys, values, scores = lookup.evicted
            self.ids += ids
            self.positions += positions
            self.predicted += predicted
            self.scores.update(scores)
            empty = self.keys is None
            self.keys = keys if empty else torch.cat([self.keys, keys], dim=2)
            self.values = values if empty else torch.cat([self.values, values], dim=2)
        if len(self.ids) > self.capacity:
            self._keep(range(len(self.ids) - self.capacity, len(self.ids)))
            kept = set(self.ids)
            self.scores = {i: s for i, s in self.scores.items() if i in kept}
        if len(self.back_at) > 2 * self.capacity:
            self.back_at = {i: t for i, t in self.back_at.items() if self.clock - t < self.cooldown}

    # --- sessions ---------------------------------------------------------------------------

    def state(self) -> dict:
        return {"index": super().state(), "scores": [[i, list(s)] for i, s in self.scores.items()]}

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"index", "scores"} or not isinstance(state["scores"], list):
            raise ValueError("recall: malformed saved state")
        scores = {}
        for item in state["scores"]:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], list)
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in item[1])):
                raise ValueError("recall: malformed saved state")
            scores[item[0]] = [float(x) for x in item[1]]
        super().load_state(state["index"])
        if set(scores) != set(self.ids):
            raise ValueError("recall: malformed saved state (scores do not match the index)")
        self.scores = scores
