"""Recall under SmartKV: a token lanes dropped comes back into them when one looks for it.

The shared-rows recall (positronic/policies/recall.py) keeps a row's K/V when the row is
evicted. Under SmartKV a token leaves lanes one by one, each when its own memory prefers
another, so the index copies a token's K/V in every lane at the one moment every lane holds
it: when it leaves the window (`capture`). From then on it can come back into any lane that
dropped it, exactly as it was (keys rotated at its position, which is where it comes back).

When: as the shared recall (every `every` ticks, at once after typed input), the newest
token's query scores the indexed keys in each lane: a lane's would-be share of a token is
exp(q·k - log Σ_lane exp(q·k')), averaged over the query heads of the lane (a kv head's
group, or all heads of a layer), against the rows the lane holds. A token comes back when a
lane lacking it would give it at least `share` of the attention it gives all its own rows
(1: as much as all of them together). It comes back with up to `span` indexed tokens nearest
to it (the text around a match is what makes it useful), into every lane that lacks each of
them: which heads will read a fact is not known when the question starts. Each lane then drops
as many of its weakest memory rows, so every lane keeps the same count.

A token taken back is held for a few ticks (the policy's `recall_hold`: no offer drops it,
else a fact the gates predicted little use for is the weakest again at once), then ranks by
its own score with a lifespan counted from its return. For `cooldown` ticks it does not come
back into the same lane again (other lanes may still take it).

The index is a ring of `capacity` tokens (SmartKVPolicy.recall_capacity: 4,096) that grows by
doubling until it is full: a token leaving the window is written into the next slot (over the
oldest when full), so a tick copies only its own rows. Keys are kept as columns: one query
against every indexed key is then a [group, head_dim] x [head_dim, rows] product, which the CPU
does in half the time of the [rows, head_dim] x [head_dim, group] one (it reads every key each
tick: this is recall's main cost).

    keys    [layers, kv_heads, head_dim, capacity]  (float32, on the CPU)
    values  [layers, kv_heads, capacity, head_dim]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.attention import grouped_logits
from ..policies.recall import Digested, Lookup, Recall
from ..util import DTYPES, is_int_list

BEHIND = 7  # a token before the match counts as this many times as far as one after it (`reach`)


def reach(offset):
    """How far a token `offset` positions from the match is, for what comes back with it (int
    arrays or tensors, elementwise): the text after a match counts as its distance, the text
    before it BEHIND times that (16 tokens: the match, 13 after it, 2 before). A question names
    what a fact is about, and the fact follows its subject: in "the special magic number for KEY
    is 48213" the question's query matched "magic" or "number", and of the 16 tokens nearest it
    by plain distance the last digits (8-12 tokens after it) were outside them (RULER-like
    needles at 4,096 tokens on lcet10.txt: bench/results/tasks.md)."""
    return offset * (offset >= 0) - BEHIND * offset * (offset < 0)


BLOCK = 128  # ring slots a saved block holds (SmolLM2 float32: 2.9 MB of keys, as much of values)


@dataclass
class LaneLookup(Lookup):
    """A Lookup that also says which lanes take each token back (ledger id -> lanes)."""

    lanes: dict[int, list[int]] = field(default_factory=dict)
    forget: bool = False  # the positions were packed since the index was filled: its keys are stale


class LaneRecall(Recall):
    """The index of window-leavers' K/V and the per-lane lookup (see the module docstring).
    `scores`: each indexed token's gate score per lane (what its rank starts from when it
    comes back)."""

    def __init__(self, heads: int, share: float = 1.0, **settings):
        super().__init__(**settings)
        self.heads = heads  # lanes per layer: 1, or the kv heads
        self.share = share  # what a lane lacking a token would give it, of all it gives its own rows
        self.scores: dict[int, list[float]] = {}
        # (ledger id, lane) -> clock of its last restore into that lane: the cooldown is per
        # lane, so a token one lane took back can still come back into the others
        self.lane_back_at: dict[tuple[int, int], int] = {}
        self._prune_above = 2 * self.capacity  # lane_back_at's size that sends it through `_prune`
        self.next = 0  # the ring's next slot: keys/values hold `capacity` rows, the first len(ids) filled
        # ("keys" or "values", block) -> sha256 of that block as the last `state()` gave it; a
        # write into a block forgets it (`_write`, `_set_rows`: the only writers of the ring)
        self._digests: dict[tuple[str, int], str] = {}

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

    def lane_logits(self, query: torch.Tensor, log_norm: torch.Tensor) -> torch.Tensor:
        """[layers, kv_heads, group, rows] float32: each query head's log would-be attention
        to each indexed token, q·k - log_norm (0: as much as all the rows it holds).
        query: [layers, heads, head_dim] (scaled, rotated); log_norm: [layers, heads]."""
        keys = self.keys[..., : len(self.ids)]  # the filled slots (a view): [layers, kv_heads, head_dim, rows]
        if query.shape[0] != keys.shape[0]:
            raise ValueError(f"recall scores every layer's keys: the query covers {query.shape[0]} of "
                             f"{keys.shape[0]} layers")
        return grouped_logits(query, keys, log_norm)

    def lane_shares(self, logits: torch.Tensor) -> torch.Tensor:
        """[lanes, rows] float32: each indexed token's would-be attention in each lane, the
        mean over the lane's query heads (logits: `lane_logits`, consumed)."""
        shares = logits.exp_()
        if self.heads == 1:  # a lane is a layer: every head of it
            return shares.mean(dim=(1, 2))
        layers, kv_heads = shares.shape[:2]
        return shares.mean(dim=2).reshape(layers * kv_heads, -1)

    def look_lanes(self, view, held: np.ndarray, room: int, *, typed: bool = False) -> Lookup:
        """This tick's lookup: `back` (ledger ids, nearest to the best match first) and
        `lanes` (ledger id -> the lanes taking it back). held: int64 [lanes, n], the ledger
        ids each lane holds after this tick's drops (-1: none); room: tokens a lane may take
        back at once (each replaces one of its memory's)."""
        lookup = LaneLookup(self.clock + 1, typed)
        if self.positions and int(view.positions[-1]) <= max(self.positions):
            # the state packed its positions (past the model's limit): indexed keys are rotated
            # at positions the tokens no longer hold, so the index starts again
            lookup.forget = True
            return lookup
        due = self.awake or lookup.clock % self.every == 0
        if not due or not self.ids or view.query is None or view.log_norm is None:
            return lookup
        logits = self.lane_logits(view.query, view.log_norm)
        # a lane's share is a mean over its heads, so no head reaching it rules it out: one
        # maximum instead of an exponential of every logit (most ticks end here)
        if float(logits.max()) < math.log(self.share):
            return lookup
        shares = self.lane_shares(logits)  # [lanes, index rows]
        if float(shares.max()) < self.share:
            return lookup  # no lane would give any indexed token that much, held or not
        missing = self._missing(held)  # [lanes, index rows]
        # a lane lacking a token would give it `share` of all the attention it gives the rows it
        # holds (its would-be share before renormalising: 1 = as much as all of them together)
        lost = (shares * torch.from_numpy(missing)).amax(dim=0)
        best = int(lost.argmax())
        if float(lost[best]) < self.share:
            return lookup
        positions = np.asarray(self.positions)
        distance = reach(positions - positions[best])
        near = [slot for slot in np.lexsort((positions, distance)) if distance[slot] <= self.span][: self.span]
        # the text around the match comes back into every lane that lacks it, as the shared
        # recall brings it back into every layer: which heads will read it is not known yet
        taken = np.zeros(len(held), dtype=np.int64)
        for slot in near:
            ledger_id = self.ids[slot]
            taking = [lane for lane in np.flatnonzero(missing[:, slot] & (taken < room)).tolist()
                      if lookup.clock - self.lane_back_at.get((ledger_id, lane), -self.cooldown) >= self.cooldown]
            taken[taking] += 1
            if taking:
                lookup.back.append(ledger_id)
                lookup.lanes[ledger_id] = taking
        return lookup

    def _missing(self, held: np.ndarray) -> np.ndarray:
        """bool [lanes, index rows]: which indexed tokens each lane lacks (held: see look_lanes)."""
        ids = np.asarray(self.ids, dtype=np.int64)
        order = np.argsort(ids)
        ordered = ids[order]
        at = np.searchsorted(ordered, held).clip(max=len(ids) - 1)
        lanes, columns = np.nonzero(ordered[at] == held)
        missing = np.ones((len(held), len(ids)), dtype=bool)
        missing[lanes, order[at[lanes, columns]]] = False
        return missing

    def restore_action(self, lookup: Lookup) -> dict:
        """The restore action for `lookup.back` (their own K/V, the lanes taking each back)."""
        return {"action": "restore", "ledger_ids": list(lookup.back),
                "lanes": [list(lookup.lanes[i]) for i in lookup.back], **self.payload(lookup.back)}

    def payload(self, ids: list[int]) -> dict:
        """The restore action's own K/V for `ids` (rows: keys back from the ring's columns)."""
        where = {i: k for k, i in enumerate(self.ids)}
        index = torch.tensor([where[i] for i in ids], dtype=torch.long)
        return {"keys": self.keys.index_select(3, index).transpose(2, 3), "values": self.values.index_select(2, index),
                "predicted": [self.predicted[where[i]] for i in ids]}

    def adopt(self, lookup: Lookup) -> None:
        """The tick went through: its clocks stand, the tokens it brought back start their
        cooldown (they stay indexed: other lanes may still want them), the tokens that left
        the window join the index (the oldest go beyond `capacity`)."""
        self.clock, self.awake = lookup.clock, lookup.awake
        if getattr(lookup, "forget", False):
            self._set_rows([], [], [], None, None)
            self.scores, self.lane_back_at = {}, {}
        if lookup.back:
            self.lane_back_at.update(((i, lane), self.clock) for i in lookup.back for lane in lookup.lanes[i])
            self.restored += len(lookup.back)
        if lookup.evicted:
            *rows, scores = lookup.evicted
            self._write(*rows)
            # only the tokens the ring kept: more than `capacity` leaving at once (a long prompt's
            # bulk prune) keeps the newest, and a score without its token made the session's
            # saved index refuse to load ("scores do not match")
            self.scores.update((i, scores[i]) for i in rows[0][-self.capacity:])
        if len(self.lane_back_at) > self._prune_above:
            self._prune()

    def _prune(self) -> None:
        """Forget the restores whose cooldown is over (the lookup treats them as never made).
        The next prune waits until the map has doubled: when most entries are still cooling
        down, pruning at a fixed size ran on every other tick (0.84 ms a tick at 600 ticks)."""
        self.lane_back_at = {k: t for k, t in self.lane_back_at.items() if self.clock - t < self.cooldown}
        self._prune_above = max(2 * self.capacity, 2 * len(self.lane_back_at))

    def _write(self, ids: list[int], positions: list[int], predicted: list[int], keys: torch.Tensor,
               values: torch.Tensor) -> None:
        """Index tokens in their slots: the next free ones, then over the oldest (a ring, so
        nothing is copied but the new rows)."""
        ids, positions, predicted = ids[-self.capacity:], positions[-self.capacity:], predicted[-self.capacity:]
        self._room(len(self.ids) + len(ids), keys, values)
        keys, values = keys[:, :, -self.capacity:], values[:, :, -self.capacity:]
        runs = self._runs(self.next, len(ids))
        slots = [slot for a, b in runs for slot in range(a, b)]
        for slot, ledger_id, position, prediction in zip(slots, ids, positions, predicted):
            if slot < len(self.ids):  # the oldest token leaves the index
                self.scores.pop(self.ids[slot], None)
                self.ids[slot], self.positions[slot], self.predicted[slot] = ledger_id, position, prediction
            else:
                self.ids.append(ledger_id), self.positions.append(position), self.predicted.append(prediction)
        columns = keys.transpose(2, 3).to(self.keys.dtype)
        values = values.to(self.values.dtype)
        first = 0
        for a, b in runs:  # slices, not an index_copy_ across the keys' columns (0.11 ms a tick for one token)
            self.keys[..., a:b] = columns[..., first : first + b - a]
            self.values[:, :, a:b] = values[:, :, first : first + b - a]
            first += b - a
            for block in range(a // BLOCK, (b - 1) // BLOCK + 1):
                self._digests.pop(("keys", block), None), self._digests.pop(("values", block), None)
        self.next = (self.next + len(ids)) % self.capacity

    def _room(self, needed: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Slots for `needed` tokens (at most `capacity`). The ring grows by doubling until it
        is full (a run that never fills it never holds 4,096 tokens' K/V: 188 MB for SmolLM2 in
        float32); until then its tokens lie in slots 0.. in order, so growing copies them as they
        lie. keys, values: [layers, kv_heads, n, head_dim], the tokens about to be written."""
        held = 0 if self.keys is None else self.keys.shape[-1]
        if min(needed, self.capacity) <= held:  # a full ring: the new tokens go over the oldest
            return
        size = min(self.capacity, max(needed, 2 * held, BLOCK))
        layers, kv_heads, _, head_dim = keys.shape
        keys, values = (keys, values) if self.keys is None else (self.keys, self.values)  # dtype and device
        grown_keys = keys.new_empty(layers, kv_heads, head_dim, size)
        grown_values = values.new_empty(layers, kv_heads, size, values.shape[-1])
        if held:
            grown_keys[..., :held] = self.keys
            grown_values[:, :, :held] = self.values
        self.keys, self.values = grown_keys, grown_values

    def _runs(self, start: int, count: int) -> list[tuple[int, int]]:
        """The ring's slots `start`, `start + 1`, ... (`count` of them, wrapping) as at most two
        runs [a, b): one, or two where the ring wraps."""
        head = min(count, self.capacity - start)
        return [(a, b) for a, b in ((start, start + head), (0, count - head)) if b > a]

    # --- sessions ---------------------------------------------------------------------------

    def _rows(self) -> tuple:
        """The indexed tokens oldest first, their K/V copied out of the ring (as `Recall.state`
        saved the index, in sessions from before the ring form)."""
        if self.keys is None:
            return [], [], [], None, None
        # oldest first: from the next slot to write once the ring is full, else from slot 0
        # (slices of the runs: a gather across the keys' columns took 13 ms at 357 tokens)
        runs = self._runs(self.next if len(self.ids) == self.capacity else 0, len(self.ids))
        order = [slot for a, b in runs for slot in range(a, b)]
        keys = torch.cat([self.keys[..., a:b] for a, b in runs], dim=3)
        values = torch.cat([self.values[:, :, a:b] for a, b in runs], dim=2)
        return ([self.ids[k] for k in order], [self.positions[k] for k in order], [self.predicted[k] for k in order],
                keys.transpose(2, 3).contiguous(), values)

    def _set_rows(self, ids, positions, predicted, keys, values) -> None:
        self.ids, self.positions, self.predicted, self.keys, self.values, self.next = [], [], [], None, None, 0
        self._digests = {}
        if keys is not None:
            self._write(ids, positions, predicted, keys, values)

    def state(self) -> dict:
        """Plain data for a session: the ring as it lies (slot order, the next slot to write) and
        its K/V in blocks of BLOCK slots, each token's rows together ([n, layers, kv_heads,
        head_dim] a block). Tokens indexed since the last save change only the blocks they fell
        in, so a session store that keeps pieces by content (brain/session.py) writes only those,
        and hashes only those: each block comes as `Digested`, its digest kept from the last
        save while nothing was written into it."""
        blocks = [(a, min(a + BLOCK, len(self.ids))) for a in range(0, len(self.ids), BLOCK)]

        def pieces(name: str, tensors) -> list[Digested]:
            made = [Digested.of(tensor, self._digests.get((name, k))) for k, tensor in enumerate(tensors)]
            self._digests.update(((name, k), piece.sha256) for k, piece in enumerate(made))
            return made

        ring = {"ids": list(self.ids), "positions": list(self.positions), "predicted": list(self.predicted),
                "next": self.next, "capacity": self.capacity, "block": BLOCK,
                "shape": [] if self.keys is None else [*self.keys.shape[:3]],  # layers, kv_heads, head_dim
                "dtype": "float32" if self.keys is None else str(self.keys.dtype).removeprefix("torch."),
                "keys": pieces("keys", (self.keys[..., a:b].permute(3, 0, 1, 2) for a, b in blocks)),
                "values": pieces("values", (self.values[:, :, a:b].permute(2, 0, 1, 3) for a, b in blocks)),
                **self.clocks()}
        return {"ring": ring, "scores": [[i, list(s)] for i, s in self.scores.items()],
                "lane_back_at": [[i, lane, t] for (i, lane), t in self.lane_back_at.items()]}

    def load_state(self, state: dict) -> None:
        """Take a `state()` back, or one saved before the ring was (the index oldest first,
        "index"); ValueError if anything is malformed (nothing changes then)."""
        form = next((key for key in ("ring", "index") if isinstance(state, dict) and key in state), None)
        if form is None or set(state) != {form, "scores", "lane_back_at"} \
                or not isinstance(state["scores"], list) or not isinstance(state["lane_back_at"], list) \
                or not all(is_int_list(item) and len(item) == 3 for item in state["lane_back_at"]):
            raise ValueError("recall: malformed saved state")
        scores = {}
        for item in state["scores"]:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], list)
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in item[1])):
                raise ValueError("recall: malformed saved state")
            scores[item[0]] = [float(x) for x in item[1]]
        index = state[form]
        if not isinstance(index, dict) or not is_int_list(index.get("ids")) or set(scores) != set(index["ids"]):
            raise ValueError("recall: malformed saved state (scores do not match the index)")
        if form == "ring":
            self._load_ring(index)
        else:
            super().load_state(index)
        self.scores = scores
        self.lane_back_at = {(i, lane): t for i, lane, t in state["lane_back_at"]}

    def _load_ring(self, ring: dict) -> None:
        """The ring of a `state()`, slot for slot when this index has the saved capacity (else
        its tokens oldest first); ValueError, and nothing changes, if it is malformed."""
        fields = {"ids", "positions", "predicted", "next", "capacity", "block", "shape", "dtype", "keys", "values",
                  "back_at", "clock", "restored", "awake"}
        count = len(ring["ids"])
        ok = (set(ring) == fields and is_int_list(ring["positions"]) and is_int_list(ring["predicted"])
              and count == len(ring["positions"]) == len(ring["predicted"]) and count <= self.capacity
              and all(type(ring[k]) is int for k in ("next", "capacity", "block")) and ring["block"] > 0
              and count <= ring["capacity"] and 0 <= ring["next"] < max(ring["capacity"], 1)
              and (count == ring["capacity"] or ring["next"] == count % ring["capacity"])
              and is_int_list(ring["shape"]) and ring["dtype"] in DTYPES and self.checked_clocks(ring)
              and isinstance(ring["keys"], list) and isinstance(ring["values"], list)
              and len(ring["keys"]) == len(ring["values"]) == -(-count // ring["block"])
              and all(isinstance(b, bytes) for b in ring["keys"] + ring["values"])
              and (len(ring["shape"]) == 3 and all(n > 0 for n in ring["shape"]) if count else not ring["shape"]))
        keys = values = None
        if ok and count:
            dtype, per_token = DTYPES[ring["dtype"]], ring["shape"]
            sizes = [min(ring["block"], count - a) for a in range(0, count, ring["block"])]
            item = torch.finfo(dtype).bits // 8 * math.prod(per_token)
            ok = all(len(k) == len(v) == n * item for k, v, n in zip(ring["keys"], ring["values"], sizes))
            if ok:  # per block [slots, layers, kv_heads, head_dim]
                keys, values = ([torch.frombuffer(bytearray(b), dtype=dtype).reshape(n, *per_token)
                                 for b, n in zip(ring[k], sizes)] for k in ("keys", "values"))
                ok = all(bool(torch.isfinite(block).all()) for block in keys + values)
        if not ok:
            raise ValueError("recall: malformed saved state")
        # this ring's capacity: written from slot 0 in slot order, it lies as it was saved (and
        # writes next where it did); another's: its tokens oldest first
        same = ring["capacity"] == self.capacity
        order = list(range(count)) if same or count < ring["capacity"] \
            else list(range(ring["next"], count)) + list(range(ring["next"]))
        pick = torch.tensor(order, dtype=torch.long)
        keys, values = (torch.cat(blocks)[pick].permute(1, 2, 0, 3) if count else None for blocks in (keys, values))
        self._set_rows([ring["ids"][k] for k in order], [ring["positions"][k] for k in order],
                       [ring["predicted"][k] for k in order], keys, values)
        if same and count:
            self.next = ring["next"]
        self.load_clocks(ring)
