"""`--memory-rank recent`: SmartKV's memory ranked by the gates *and* by the attention each
lane has paid its memory rows lately.

The gates predict a token's lifespan from its key alone, once, when it leaves the window.
Recent attention is what the lane's queries actually did with the row since. Here a lane's
memory row ranks by

    rank = gate rank (rows.py, `Memories`) * (1 + used) ** BETA

`used`: after every forward, the newest query's attention share of each row of the lane (the
largest over the query heads that read the lane's kv head, times the lane's row count, so that
1 is a uniform share), summed with a decay of DECAY a tick (0.97: about the last 32 ticks). A
row no query looked at lately keeps its gate rank; one in use ranks higher.

A token enters a lane's memory (from the window, or taken back by recall) with nothing counted:
what counts is use *while in the memory*. The attention a token got inside the window adds
little to what predicts its use after it (bench/results/smartkv.md, 2026-11-27), and carrying
it let recent text push out rows the gates rank high, such as a fact stated long ago (the
retrieval probe lost it; counting from entry loses less, bench/results/smartkv.md, stop 65).

Measured in `bench/observed_rank.py --fresh` first, which patches the default policy the same way;
tests/positronic/smartkv/test_recent.py holds the product to the prototype's numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from .rows import Memories

BETA = 2.0  # the power of (1 + used) in the rank (bench/results/smartkv.md: 1 moved the cells less)
DECAY = 0.97  # the sums' decay per tick: about the last 32 ticks count


class RecentMemories(Memories):
    """Memories whose rank also weighs each row's recent attention in its lane: the array
    `used` [layers, size + 1] (float64, by slot, like the others) holds the decayed sums."""

    NAMES = (*Memories.NAMES, "used")
    watches = True

    def __init__(self, layers: int, size: int, horizon: int):
        super().__init__(layers, size, horizon)
        self.used = np.zeros((layers, size + 1))

    def _unheld_ranks(self, now: int, at: tuple) -> np.ndarray:
        return super()._unheld_ranks(now, at) * (1.0 + self.used[at]) ** BETA

    def offer(self, token_id, position: int, scores, now: int) -> np.ndarray:
        self.used[:, self.count if self.count < self.size else self.size] = 0.0  # the newcomer: nothing counted
        return super().offer(token_id, position, scores, now)

    def take_back(self, layer: int, token_ids: list[int], scores: list[float], now: int, hold: int = 0) -> list[int]:
        dropped = super().take_back(layer, token_ids, scores, now, hold)
        self.used[layer, : self.size][np.isin(self.ids[layer, : self.size], token_ids)] = 0.0  # counted from now
        return dropped

    def attend(self, lane_ids: np.ndarray, share: np.ndarray) -> None:
        """A tick's attention: every held row's sum decays, then gains the row's `share`.
        lane_ids: int64 [layers, rows], the ledger ids each lane's cache rows hold (every token
        the memory holds among them); share: float [layers, rows], in the same order.
        RuntimeError if a held token is not among its lane's rows (the memory and the cache
        disagree: the state is rebuilt rather than ranked on a wrong sum)."""
        held = self.ids[:, : self.count]
        if not held.size:
            return
        lanes, rows = lane_ids.shape
        if lanes != self.layers or share.shape != lane_ids.shape:
            raise ValueError(f"attention of {lanes} lanes x {rows} rows for a memory of {self.layers} "
                             f"(shares {tuple(share.shape)})")
        span = int(max(lane_ids.max(), held.max())) + 1
        base = np.arange(self.layers)[:, None] * span
        keys = (base + lane_ids).ravel()
        order = np.argsort(keys, kind="stable")
        wanted = (base + held).ravel()
        at = np.minimum(np.searchsorted(keys, wanted, sorter=order), keys.size - 1)
        found = order[at]
        if (keys[found] != wanted).any():
            lane = int(np.flatnonzero(keys[found] != wanted)[0]) // held.shape[1]
            raise RuntimeError(f"lane {lane}'s memory holds a token its cache rows do not")
        self.used[:, : self.count] = DECAY * self.used[:, : self.count] + share.ravel()[found].reshape(held.shape)


def lane_shares(view, heads: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The newest query's attention to each row of each lane, as `attend` takes it: (ledger ids
    int64 [lanes, rows], shares float32 [lanes, rows]). A lane's share of a row is the largest
    over the query heads reading it (a kv head's group, or every head of a layer when `heads`
    is 1), times the lane's rows: 1 is a uniform share. view: a view with keys (the newest
    query and log-normaliser, and a reader of per-lane rows). None when the state has no
    newest query (just rebuilt from the mirror): that tick counts nothing."""
    if view.query is None or view.log_norm is None:
        return None
    keys = view.rows.lane_keys()  # [layers, kv_heads, rows, head_dim], float32 on the CPU (a copy)
    layers, kv_heads, rows, head_dim = keys.shape
    if view.query.shape[0] != layers:
        raise ValueError(f"the recent-use rank reads every layer's query: it covers {view.query.shape[0]} of {layers}")
    query = view.query.to("cpu", torch.float32).reshape(layers, kv_heads, -1, head_dim)
    logits = query @ keys.transpose(-1, -2)  # [layers, kv_heads, group, rows]
    share = torch.exp(logits - view.log_norm.to("cpu", torch.float32).reshape(layers, kv_heads, -1, 1))
    per_lane = share.amax(dim=2) if heads == kv_heads else share.amax(dim=(1, 2))  # [lanes..., rows]
    ids = np.asarray(view.rows.lane_ids(), dtype=np.int64)  # [lanes, rows]
    return ids, (per_lane * rows).reshape(ids.shape).numpy()
