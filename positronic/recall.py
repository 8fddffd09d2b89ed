"""Recall: evicted rows come back when the context asks for them.

No bounded cache of the field keeps a token once it is evicted. Here the ledger keeps every
token and the RoPE position it held, and live positions keep the gaps evicted rows left, so
an evicted row can be put back exactly where it was (StateManager's `restore` action; its
K/V are recomputed in the tick's one forward, seeing the rows left of it).

Which rows: when a row is evicted, its keys on the scored layers are kept here, as they were
in the cache (rotated at the position it held, which is where it would come back). Each tick
the newest token's query scores them like live rows: the would-be attention of an evicted row
is exp(q·k − log Σ_live exp(q·k')), averaged over the scored layers and heads like the live
rows' scores (steps.scores). If the best evicted row would get at least `threshold` times a
live row's fair share (1 / live rows), it comes back with the evicted rows around it (up to
`span` rows, nearest positions first; the text around a match is what makes it useful), and
the policy frees as many more rows in the same tick. A row that came back cannot come back
again for `cooldown` ticks after it is evicted again, so nothing flickers in and out.

Memory: `capacity` evicted rows at most (oldest dropped first), each
layers × kv_heads × head_dim float32 (SmolLM2, last layer: 768 bytes).
Cost: one [rows × heads × head_dim] product per tick (see bench/decode.py).

    keys   [capacity, scored layers, kv_heads, head_dim] float32
"""

from __future__ import annotations

import torch

DEFAULT_THRESHOLD = 8.0  # × a live row's fair share of attention
DEFAULT_SPAN = 16  # rows restored around the best match
DEFAULT_CAPACITY = 16384  # evicted rows kept recallable
DEFAULT_COOLDOWN = 64  # ticks before a restored row may come back again


class Recall:
    def __init__(self, *, threshold: float = DEFAULT_THRESHOLD, span: int = DEFAULT_SPAN,
                 capacity: int = DEFAULT_CAPACITY, cooldown: int = DEFAULT_COOLDOWN):
        self.threshold, self.span, self.capacity, self.cooldown = threshold, span, capacity, cooldown
        self.ids: list[int] = []  # ledger id per kept row, in order of eviction
        self.positions: list[int] = []
        self.keys: torch.Tensor | None = None  # [rows, layers, kv_heads, head_dim]
        self.back_at: dict[int, int] = {}  # ledger id -> clock of its last restore
        self.clock = 0  # plans so far
        self.restored = 0  # rows brought back so far
        self._pending: tuple[list[int], list[int], torch.Tensor | None, list[int]] | None = None
        self._clock_before: int | None = None

    def __len__(self) -> int:
        return len(self.ids)

    # --- one tick ---------------------------------------------------------------------------

    def choose(self, view) -> list[int]:
        """Ledger ids to bring back this tick (nearest to the best match first), or []."""
        self._clock_before = self.clock
        self.clock += 1
        if not self.ids or view.query is None or view.log_norm is None:
            return []
        layers, heads, head_dim = view.query.shape
        kv_heads = self.keys.shape[2]
        query = view.query.reshape(layers, kv_heads, heads // kv_heads, head_dim)
        logits = torch.einsum("nlkd,lkgd->nlkg", self.keys, query)  # [rows, layers, kv_heads, group]
        share = (logits - view.log_norm.reshape(layers, kv_heads, -1)).exp().mean(dim=(1, 2, 3))  # [rows]
        best = int(share.argmax())
        if float(share[best]) * len(view) < self.threshold:
            return []
        live = set(view.positions.tolist())
        center = self.positions[best]
        near = sorted((abs(p - center), p, i) for i, p in zip(self.ids, self.positions)
                      if abs(p - center) <= self.span and p not in live
                      and self.clock - self.back_at.get(i, -self.cooldown) >= self.cooldown)
        return [i for _, _, i in near[: self.span]]

    def plan(self, view, evicted_rows: list[int], restored: list[int]) -> None:
        """What this tick's plan does (rows taken out, ids brought back); it takes effect at
        `commit`, once the tick went through, and is dropped by `discard`."""
        keys = view.keys[:, :, evicted_rows].permute(2, 0, 1, 3).contiguous() if evicted_rows and view.keys is not None else None
        ids = [int(view.ledger_ids[r]) for r in evicted_rows] if keys is not None else []
        self._pending = (ids, [int(view.positions[r]) for r in evicted_rows] if keys is not None else [], keys, list(restored))

    def commit(self) -> None:
        if self._pending is None:
            return
        ids, positions, keys, restored = self._pending
        self._pending = self._clock_before = None
        if restored:
            back = set(restored)
            keep = [k for k, i in enumerate(self.ids) if i not in back]
            self.ids = [self.ids[k] for k in keep]
            self.positions = [self.positions[k] for k in keep]
            self.keys = self.keys[keep]
            self.back_at.update((i, self.clock) for i in restored)
            self.restored += len(restored)
        if ids:
            self.ids += ids
            self.positions += positions
            self.keys = keys if self.keys is None or not len(self.keys) else torch.cat([self.keys, keys])
        if len(self.ids) > self.capacity:  # the oldest evictions go first
            drop = len(self.ids) - self.capacity
            self.ids, self.positions, self.keys = self.ids[drop:], self.positions[drop:], self.keys[drop:]
        if len(self.back_at) > 2 * self.capacity:
            self.back_at = {i: t for i, t in self.back_at.items() if self.clock - t < self.cooldown}

    def discard(self) -> None:
        """The tick did not happen: forget its plan (and its clock tick)."""
        if self._clock_before is not None:
            self.clock = self._clock_before
        self._pending = self._clock_before = None

    # --- sessions ---------------------------------------------------------------------------

    def state(self) -> dict:
        keys = self.keys if self.keys is not None else torch.empty(0)
        return {"ids": list(self.ids), "positions": list(self.positions), "shape": list(keys.shape),
                "keys": keys.numpy().tobytes(), "back_at": [[i, t] for i, t in self.back_at.items()],
                "clock": self.clock, "restored": self.restored}

    def load_state(self, state: dict) -> None:
        def ints(value):
            return isinstance(value, list) and all(type(v) is int for v in value)

        ok = (isinstance(state, dict) and set(state) == {"ids", "positions", "shape", "keys", "back_at", "clock", "restored"}
              and ints(state["ids"]) and ints(state["positions"]) and len(state["ids"]) == len(state["positions"])
              and len(state["ids"]) <= self.capacity and ints(state["shape"]) and isinstance(state["keys"], bytes)
              and isinstance(state["back_at"], list) and all(ints(p) and len(p) == 2 for p in state["back_at"])
              and type(state["clock"]) is int and type(state["restored"]) is int)
        if ok and state["ids"]:
            shape = state["shape"]
            ok = len(shape) == 4 and shape[0] == len(state["ids"]) and all(s > 0 for s in shape) \
                and len(state["keys"]) == 4 * shape[0] * shape[1] * shape[2] * shape[3]
        if not ok:
            raise ValueError("recall: malformed saved state")
        keys = (torch.frombuffer(bytearray(state["keys"]), dtype=torch.float32).reshape(state["shape"])
                if state["ids"] else None)
        if keys is not None and not bool(torch.isfinite(keys).all()):
            raise ValueError("recall: saved keys are not finite")
        self.ids, self.positions, self.keys = list(state["ids"]), list(state["positions"]), keys
        self.back_at = {i: t for i, t in state["back_at"]}
        self.clock, self.restored, self._pending = state["clock"], state["restored"], None
