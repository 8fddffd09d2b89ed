"""What policies, repairers and tools read of the state: a `ContextView` snapshot (fresh
tensors: changing them changes nothing) and, with it, a `RowReader` that copies live rows'
K/V out for as long as the state is as the view saw it; `StateReads`, the StateManager's
read-only accessors (counts, copies, the view itself)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..kv import formats as kv_formats
from ..models import attention
from ..util import from_list


@dataclass(frozen=True)
class ContextView:
    """A read-only snapshot of the live context for policies and repairers (fresh tensors:
    changing them changes nothing). All [rows], in cache order.

    predicted: the model's greedy next token after each row, computed by the forward that
    wrote the row (the predict service a repairer uses: what the model expects at a slot).
    """

    token_ids: torch.Tensor
    ledger_ids: torch.Tensor
    positions: torch.Tensor
    brightness: torch.Tensor
    predicted: torch.Tensor
    pinned: torch.Tensor | None = None  # bool [rows]
    # with view(keys=True): the newest row's query / log-normaliser (see forward.ForwardResult),
    # and `rows`, which copies live rows' K/V out while the state is as this view saw it
    query: torch.Tensor | None = None
    log_norm: torch.Tensor | None = None
    rows: "RowReader | None" = None

    def __len__(self) -> int:
        return len(self.token_ids)


class RowReader:
    """Copies of live rows' K/V in every layer, for the view it came with: reading after the
    state changed (an edit, a rebuild) raises, so a view never mixes two states.
    `state` is the StateManager (its version and lane counts); `cache`, `mirror` its blades."""

    def __init__(self, state, cache, mirror):
        self._state, self._version = state, state.version
        self._cache, self._mirror = cache, mirror

    def __call__(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values: [layers, kv_heads, len(rows), head_dim] on the CPU, in the cache's dtype
        (keys rotated at the rows' positions)."""
        self._refuse_if_stale()
        if self._state.per_layer:
            raise ValueError("layers keep different rows: read them by ledger id (layer_rows)")
        layers = self._cache.layers
        index = torch.tensor(rows, dtype=torch.long, device=self._state.lm.device)
        keys = torch.stack([layer.keys[0].index_select(1, index) for layer in layers]).cpu()
        values = torch.stack([layer.values[0].index_select(1, index) for layer in layers]).cpu()
        return keys, values

    def layer_rows(self, ledger_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [layers, kv_heads, n, head_dim] (on the CPU, float32; keys rotated at
        their positions) of tokens every lane holds, per-layer (or per-head) rows or not, each
        kv head's from its own rows; ValueError if a lane lacks one."""
        self._refuse_if_stale()
        lanes = self._mirror.layers
        if lanes is None:  # every layer holds the live rows
            where = {ledger_id: row for row, ledger_id in enumerate(self._mirror.live.ledger_ids)}
            if missing := [i for i in ledger_ids if i not in where]:
                raise ValueError(f"the live rows do not hold ledger ids {missing[:5]}")
            found = [[where[i] for i in ledger_ids]] * len(self._cache.layers)
        else:  # tokens at the window's edge lie at the same rows in every lane: one search, checked
            found = self._same_rows(lanes.rows, ledger_ids) or [
                self._lane_rows(lane, held, ledger_ids) for lane, held in enumerate(lanes.rows)]
        keys, values = self._cache.lane_rows(found)  # [layers, kv_heads, n, head_dim]
        return keys.float().cpu(), values.float().cpu()

    def lane_ids(self) -> list[list[int]]:
        """Per-layer (or per-head) rows only: each lane's ledger ids in its cache-row order (a copy)."""
        self._refuse_if_stale()
        if self._mirror.layers is None:
            raise ValueError("lane ids need per-layer rows: every layer holds the live map")
        return [list(lane) for lane in self._mirror.layers.rows]

    def lane_keys(self) -> torch.Tensor:
        """Every lane's keys [layers, kv_heads, rows, head_dim] in its cache-row order (float32
        on the CPU, rotated at their positions; a copy): row i of lane l holds `lane_ids()[l][i]`."""
        return self._lane_keys().to("cpu", torch.float32, copy=True)

    def lane_scores(self, query: torch.Tensor, log_norm: torch.Tensor | None = None) -> torch.Tensor:
        """query · keyᵀ (minus `log_norm` [layers, heads] if given) for every lane's rows in its
        cache-row order: float32 [layers, kv_heads, heads // kv_heads, rows], where the cache
        is (`attention.grouped_logits`). query: [layers, heads, head_dim], scaled as the view's
        (`ContextView.query`). The keys are read where they lie, not copied: only the product
        is new (a tick's recent-use rank reads every lane; a copy of every key was a third of
        its cost on a CPU)."""
        keys = self._lane_keys()
        layers, kv_heads, _, head_dim = keys.shape
        if query.dim() != 3 or query.shape[0] != layers or query.shape[1] % kv_heads or query.shape[2] != head_dim:
            raise ValueError(f"lane scores need a query of every layer, [{layers}, heads (a multiple of {kv_heads}), "
                             f"{head_dim}]; got {tuple(query.shape)}")
        return attention.grouped_logits(query, keys.transpose(-1, -2), log_norm)

    def _lane_keys(self) -> torch.Tensor:
        """[layers, kv_heads, rows, head_dim] as the cache holds them (a view of a Slab: read only)."""
        self._refuse_if_stale()
        if self._mirror.layers is None:
            raise ValueError("lane keys need per-layer rows: read every layer's rows with the reader itself")
        return self._cache.layer_keys(list(range(len(self._cache.layers))), len(self._mirror.layers))

    def lane_rows(self, ledger_ids: list[list[int]]) -> list[list[int]]:
        """Per-layer (or per-head) rows only: for each lane, the cache rows of its `ledger_ids`;
        ValueError if a lane does not hold one."""
        self._refuse_if_stale()
        layers = self._mirror.layers
        if layers is None or len(ledger_ids) != layers.num_layers:
            raise ValueError(f"rows by lane need per-layer rows and one id list per lane, got {len(ledger_ids)}")
        return [self._lane_rows(lane, held, wanted) for lane, (held, wanted) in enumerate(zip(layers.rows, ledger_ids))]

    @staticmethod
    def _same_rows(lanes: list[list[int]], wanted: list[int]) -> list[list[int]] | None:
        """[rows] per lane if every lane holds each of `wanted` at the row the first lane does
        (the search in the others would find just that: ids ascend in a lane), else None."""
        first = lanes[0]
        rows = [bisect.bisect_left(first, ledger_id) for ledger_id in wanted]
        if all(row < len(held) and held[row] == ledger_id for held in lanes for row, ledger_id in zip(rows, wanted)):
            return [rows] * len(lanes)
        return None

    @staticmethod
    def _lane_rows(lane: int, held: list[int], wanted: list[int]) -> list[int]:
        """The rows of `wanted` in a lane holding `held` (per-layer rows: ids ascend with rows,
        as ids are handed out in position order, so a search, not a map of the whole lane)."""
        rows = [bisect.bisect_left(held, ledger_id) for ledger_id in wanted]
        if any(row == len(held) or held[row] != ledger_id for row, ledger_id in zip(rows, wanted)):
            raise ValueError(f"lane {lane} does not hold all of ledger ids {wanted[:5]}")
        return rows

    def _refuse_if_stale(self) -> None:
        if self._state.version != self._version:
            raise ValueError("this view is stale: the state changed after it was taken")


def snapshot(state, mirror, predicted: list[int], *, keys: bool, rows: RowReader | None) -> ContextView:
    """The ContextView of `state` (a StateManager) whose mirror is `mirror` and whose rows'
    predictions are `predicted`; `keys`: with the newest query and log-normaliser."""
    entries = mirror.ledger.entries

    def copy(tensor):
        return None if tensor is None or not keys else tensor.detach().clone().cpu()
    return ContextView(
        token_ids=from_list(mirror.live_token_ids(), torch.long),
        ledger_ids=from_list(mirror.live.ledger_ids, torch.long),
        positions=from_list(mirror.live.positions, torch.long),
        brightness=from_list(mirror.brightness(), torch.float32),
        predicted=from_list(predicted, torch.long),
        pinned=from_list([entries[i].pinned for i in mirror.live.ledger_ids], torch.bool),
        query=copy(state.last_query), log_norm=copy(state.last_log_norm), rows=rows)


class StateReads:
    """The StateManager's reads: counts, copies and views, nothing that changes the state.
    (A StateManager holds `lm`, `kv_format`, its blades `_cache` and `_mirror`, and per live
    row `_predicted`.)"""

    def __len__(self) -> int:
        return len(self._mirror)

    @property
    def per_layer(self) -> bool:
        """True when layers keep different rows (`split_layers`): the live map is the union."""
        return self._mirror.layers is not None

    @property
    def lanes(self) -> int:
        """Units that keep their own rows: the layers, or with per-head rows layers × kv heads
        (lane = layer * kv_heads + head); 0 while every layer holds the same rows."""
        return self._mirror.layers.num_layers if self.per_layer else 0

    @property
    def lanes_per_layer(self) -> int:
        """1 (a lane per layer, or no lanes at all) or the kv heads (per-head rows)."""
        return max(1, self.lanes // self.lm.num_layers)

    @property
    def rows_per_layer(self) -> int:
        """Rows each layer's cache holds (the live length, unless layers keep different rows)."""
        return len(self._mirror.layers) if self.per_layer else len(self._mirror)

    @property
    def version(self) -> int:
        """Moves on with every change to the cache (an edit, a rebuild): a view taken before is stale."""
        return self._version

    @property
    def broken(self) -> str | None:
        """Why the state is unusable (a rebuild failed), or None."""
        return self._broken

    @property
    def edits(self) -> int:
        """Coupled edits (applied layouts) since this manager was created."""
        return self._edits

    def live_token_ids(self) -> list[int]:
        return self._mirror.live_token_ids()

    def positions(self) -> list[int]:
        return self._mirror.positions()

    def layer_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer `index`'s live keys and values, [1, kv_heads, rows, head_dim]
        (decoded, with a 4-bit kv_format)."""
        layer = self._cache.layers[index]
        return layer.keys.clone(), layer.values.clone()

    def memory_bytes(self) -> int:
        """Bytes the cache holds: K/V buffers (4-bit: codes and scales), spare rows and scratch."""
        return self._cache.memory_bytes()

    def bytes_per_token(self) -> int:
        """Cache bytes one live token takes in this state's kv_format (every layer's K and V)."""
        lm = self.lm
        return kv_formats.bytes_per_token(self.kv_format, layers=lm.num_layers, kv_heads=lm.num_kv_heads,
                                          head_dim=lm.head_dim, dtype=lm.dtype,
                                          lanes=self.lanes if self.per_layer else 0)

    def view(self, *, keys: bool = False) -> ContextView:
        """A read-only snapshot; `keys`: with the newest query and a reader of rows' K/V."""
        rows = RowReader(self, self._cache, self._mirror) if keys else None
        return snapshot(self, self._mirror, self._predicted, keys=keys, rows=rows)
