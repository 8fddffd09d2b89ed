"""`--memory-rank recent`: SmartKV's memory ranked by the gates *and* by the attention each
lane has paid its rows lately.

The gates predict a token's lifespan from its key alone, once, when it leaves the window.
Recent attention is what the lane's queries actually did with the row. Here a lane's memory
row ranks by

    rank = gate rank (rows.py, `Memories`) * (1 + used) ** BETA

`used`: after every forward, the newest query's attention share of each row of the lane (the
largest over the query heads that read the lane's kv head, times the lane's row count, so that
1 is a uniform share), summed with a decay of DECAY a tick (0.97: about the last 32 ticks). A
row no query looked at lately keeps its gate rank; one in use ranks higher.

The sums run while a token is in the window too (every lane holds it there), and it enters each
lane's memory with its sum in that lane: a token the text is still using when it leaves the
window competes with that use counted. Counted from entry instead (the window's attention
dropped), A Tale of Two Cities lost 1.5% at a 25% budget (bench/results/history/smartkv.md, 2026-11-29). A
token recall takes back starts again from nothing (it is held for a while anyway, `recall_hold`).

Measured with `bench/observed_rank.py --fresh-back` first, which patches the default policy the
same way with a table of its own; tests/positronic/smartkv/test_recent.py holds the brain to it.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from .rows import Memories

BETA = 2.0  # the power of (1 + used) in the rank (bench/results/history/smartkv.md: 1 moved the cells less)
DECAY = 0.97  # the sums' decay per tick: about the last 32 ticks count


class RecentMemories(Memories):
    """Memories whose rank also weighs each row's recent attention in its lane. `used`
    [layers, size + 1] (float64, by slot, like the other arrays): the decayed sums of the rows
    held; `window_ids` int64 [n] and `window_used` [layers, n]: those of the window's tokens
    (ledger ids ascending), which a token takes with it when it is offered."""

    NAMES = (*Memories.NAMES, "used")
    watches = True

    def __init__(self, layers: int, size: int, horizon: int):
        super().__init__(layers, size, horizon)
        self.used = np.zeros((layers, size + 1))
        self.window_ids = np.zeros(0, dtype=np.int64)
        self.window_used = np.zeros((layers, 0))

    def copy(self) -> "RecentMemories":
        twin = super().copy()
        twin.window_ids, twin.window_used = self.window_ids.copy(), self.window_used.copy()
        return twin

    def _unheld_ranks(self, now: int, at: tuple) -> np.ndarray:
        return super()._unheld_ranks(now, at) * (1.0 + self.used[at]) ** BETA

    def offer(self, token_id, position: int, scores, now: int) -> np.ndarray:
        """A window token's sums come with it (none for a token the window never counted)."""
        at = np.flatnonzero(self.window_ids == token_id)
        column = self.count if self.count < self.size else self.size
        self.used[:, column] = self.window_used[:, at[0]] if len(at) else 0.0
        return super().offer(token_id, position, scores, now)

    def take_back(self, layer: int, token_ids: list[int], scores: list[float], now: int, hold: int = 0) -> list[int]:
        dropped = super().take_back(layer, token_ids, scores, now, hold)
        self.used[layer, : self.size][np.isin(self.ids[layer, : self.size], token_ids)] = 0.0  # counted from now
        return dropped

    def attend(self, lane_ids: np.ndarray, share: np.ndarray, newer_than: int) -> None:
        """A tick's attention: every sum decays, then gains the row's `share`. lane_ids: int64
        [layers, rows], the ledger ids each lane's cache rows hold (ascending: every token the
        memory holds among them, the window's last); share: float [layers, rows], in the same
        order; the window's tokens are those above `newer_than` (every lane holds them).
        RuntimeError if a held token is not among its lane's rows, or the lanes' windows differ
        (the memory and the cache disagree: the state is rebuilt rather than ranked on a wrong sum)."""
        lanes, rows = lane_ids.shape
        if lanes != self.layers or share.shape != lane_ids.shape:
            raise ValueError(f"attention of {lanes} lanes x {rows} rows for a memory of {self.layers} "
                             f"(shares {tuple(share.shape)})")
        if self.count:
            found = self._rows_of(lane_ids, self.ids[:, : self.count])
            self.used[:, : self.count] = DECAY * self.used[:, : self.count] + share.ravel()[found]
        window = int(np.count_nonzero(lane_ids[0] > newer_than))
        ids = lane_ids[:, rows - window:]
        if window and ((ids != ids[0]).any() or (lane_ids[:, : rows - window] > newer_than).any()):
            raise RuntimeError("the lanes' newest rows are not the same window tokens")
        ids, sums = ids[0].copy(), share[:, rows - window:].astype(np.float64)
        at = np.minimum(np.searchsorted(self.window_ids, ids), max(len(self.window_ids) - 1, 0))
        seen = np.flatnonzero(self.window_ids[at] == ids) if len(self.window_ids) else np.zeros(0, dtype=np.int64)
        sums[:, seen] += DECAY * self.window_used[:, at[seen]]
        self.window_ids, self.window_used = ids, sums

    def _rows_of(self, lane_ids: np.ndarray, held: np.ndarray) -> np.ndarray:
        """Flat indexes into lane_ids [layers, rows] of each lane's `held` ids [layers, n]. A
        lane's ids ascend (the mirror keeps them in ledger order), so lane l's, offset by l times
        a span above every id, make one ascending array: one search finds them all."""
        if (np.diff(lane_ids, axis=1) <= 0).any():
            raise RuntimeError("a lane's rows are not in ledger order")
        span = int(max(lane_ids.max(), held.max())) + 1
        base = np.arange(self.layers)[:, None] * span
        keys = (base + lane_ids).ravel()
        wanted = base + held
        found = np.minimum(np.searchsorted(keys, wanted.ravel()), keys.size - 1).reshape(held.shape)
        if (keys[found] != wanted).any():
            lane = int(np.flatnonzero((keys[found] != wanted).any(axis=1))[0])
            raise RuntimeError(f"lane {lane}'s memory holds a token its cache rows do not")
        return found

    def sums(self) -> dict:
        """The sums, for a session: `used` [layers][held] by slot, and `window_used`, [ledger id,
        [sum per lane]] of each window token counted."""
        return {"used": self.used[:, : self.count].tolist(),
                "window_used": [[int(i), sums] for i, sums in zip(self.window_ids.tolist(), self.window_used.T.tolist())]}

    def load_sums(self, state: dict) -> None:
        """From `sums()`, into a memory `from_entries` made; ValueError naming what is malformed
        (nothing changed then)."""
        try:
            used = np.asarray(state["used"], dtype=np.float64)
            entries = state["window_used"]
            ids = np.array([i for i, _ in entries], dtype=np.int64)
            typed = all(type(i) is int for i, _ in entries) and bool((np.diff(ids) > 0).all())
            window = np.array([s for _, s in entries], dtype=np.float64).reshape(len(entries), self.layers).T
        except (KeyError, TypeError, ValueError):
            raise ValueError("the recent-use sums are malformed") from None
        if used.shape != (self.layers, self.count) or not typed:
            raise ValueError("the recent-use sums are malformed")
        if not (np.isfinite(used).all() and np.isfinite(window).all() and (used >= 0).all() and (window >= 0).all()):
            raise ValueError("the recent-use sums hold negative or non-finite values")
        self.used[:, : self.count] = used
        self.window_ids, self.window_used = ids, window


def lane_shares(view, heads: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The newest query's attention to each row of each lane, as `attend` takes it: (ledger ids
    int64 [lanes, rows], shares float32 [lanes, rows]). A lane's share of a row is the largest
    over the query heads reading it (a kv head's group, or every head of a layer when `heads`
    is 1), times the lane's rows: 1 is a uniform share. view: a view with keys (the newest
    query and log-normaliser, and a reader of per-lane rows). None when the state has no
    newest query (just rebuilt from the mirror): that tick counts nothing."""
    if view.query is None or view.log_norm is None:
        return None
    logits = view.rows.lane_scores(view.query, view.log_norm)  # [layers, kv_heads, group, rows], where the cache is
    kv_heads, rows = logits.shape[1], logits.shape[3]
    # the largest share is the share of the largest logit: one exp a row, not one a head
    per_lane = (logits.amax(dim=2) if heads == kv_heads else logits.amax(dim=(1, 2))).exp_()  # [lanes..., rows]
    lanes = view.rows.lane_ids()
    ids = np.fromiter(chain.from_iterable(lanes), np.int64, count=len(lanes) * rows).reshape(len(lanes), rows)
    return ids, (per_lane * rows).reshape(ids.shape).cpu().numpy()  # [lanes, rows] back, not the keys
