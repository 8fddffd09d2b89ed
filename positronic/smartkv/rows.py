"""Which cache slot holds which token, in one layer of a SmartKVCache (pure Python, no tensors).

A layer has `sinks + budget + window` slots. A token enters with its position and gate score:

- position < sinks: a **sink**, kept for good;
- otherwise it joins the **window**, a FIFO of the `window` most recent non-sink tokens. When
  the window overflows, its oldest token leaves and competes for **long-term memory**, a
  min-heap of at most `budget` tokens by score: it goes in if there is room or if it beats
  the lowest score there (which is then evicted); otherwise it is dropped.

A token that leaves frees its slot and the next token to need one takes it, so the layer
never holds more than its capacity and, once full, exactly its capacity: every layer of a
cache admits the same tokens, so every layer holds the same number of rows whatever its
gate chose. A heap that always keeps the best `budget` of everything offered ends up with
the top `budget` of all offers, so admitting a long prompt token by token is also the bulk
prune the seed describes (sinks, last `window`, top `budget` of the rest by score).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class Row:
    """One admitted token: its RoPE position, gate score (None: not scored yet; a window row
    needs one only when it leaves the window), and slot (None: not placed / gone)."""

    position: int
    score: float | None
    slot: int | None = None


class RowBook:
    """Slot bookkeeping of one layer (see the module docstring)."""

    def __init__(self, sinks: int, budget: int, window: int):
        if min(sinks, budget, window) < 0 or sinks + budget + window < 1:
            raise ValueError(f"sinks, budget and window must be >= 0 with a positive sum, got {sinks}, {budget}, {window}")
        self.sinks, self.budget, self.window_size = sinks, budget, window
        self.capacity = sinks + budget + window
        self.size = 0                          # slots ever used (grows to capacity)
        self._free: list[int] = []             # slots given back, reused first
        self._sink_rows: list[Row] = []
        self._window: deque[Row] = deque()     # oldest first
        self._memory: list[tuple[float, int, Row]] = []  # min-heap (score, position, row)
        self._by_slot: list[Row | None] = []

    # --- admission -------------------------------------------------------------------------

    def admit(self, positions: list[int], scores: list[float | None]) -> list[tuple[int, int]]:
        """Admit tokens in order. Returns (slot, i) for every one of them still held at the
        end, i being its index in the arguments: the caller writes token i's K/V into that
        slot. Slots not named keep what they held. A score may be None for a token that stays
        in the window; every row that leaves the window must have one by then (`unscored`,
        `set_scores`), else RuntimeError."""
        rows = []
        for position, score in zip(positions, scores, strict=True):
            row = Row(int(position), None if score is None else float(score))
            self._admit(row)
            rows.append(row)
        return [(row.slot, i) for i, row in enumerate(rows) if row.slot is not None]

    def _admit(self, row: Row) -> None:
        if row.position < self.sinks:
            self._place(row)
            self._sink_rows.append(row)
            return
        self._window.append(row)
        if len(self._window) > self.window_size:
            self._offer(self._window.popleft())
        if self._window and self._window[-1] is row:  # still in the window (window 0: it left at once)
            self._place(row)

    def _offer(self, row: Row) -> None:
        """`row` has left the window: into long-term memory, or gone."""
        if self.budget == 0:
            self._release(row)
            return
        if row.score is None:
            raise RuntimeError(f"the token at position {row.position} left the window unscored")
        if len(self._memory) < self.budget:
            heapq.heappush(self._memory, (row.score, row.position, row))
        elif row.score > self._memory[0][0]:
            _, _, evicted = heapq.heapreplace(self._memory, (row.score, row.position, row))
            self._release(evicted)
        else:
            self._release(row)
            return
        if row.slot is None:  # window 0: the token went straight to memory
            self._place(row)

    def _place(self, row: Row) -> None:
        if self._free:
            row.slot = self._free.pop()
            self._by_slot[row.slot] = row
        else:
            if self.size >= self.capacity:  # cannot happen: sinks, window and memory are each bounded
                raise RuntimeError("no free slot")
            row.slot = self.size
            self._by_slot.append(row)
            self.size += 1

    def _release(self, row: Row) -> None:
        if row.slot is not None:
            self._by_slot[row.slot] = None
            self._free.append(row.slot)
            row.slot = None

    # --- lazy scores -------------------------------------------------------------------------

    def unscored(self, arriving: int) -> list[Row]:
        """The window's unscored rows, oldest first, if `arriving` more non-sink tokens would
        push one of them out of the window (and long-term memory would need its score); else
        []. Every unscored window row is returned then, so scores come in batches."""
        if self.budget == 0:
            return []
        leaving = len(self._window) + arriving - self.window_size
        if leaving <= 0 or all(row.score is not None for row in list(self._window)[:leaving]):
            return []
        return [row for row in self._window if row.score is None]

    @staticmethod
    def set_scores(rows: list[Row], scores: list[float]) -> None:
        for row, score in zip(rows, scores, strict=True):
            row.score = float(score)

    # --- facts -----------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Tokens held now (== size once nothing is free, i.e. after every complete admission)."""
        return self.size - len(self._free)

    def positions(self) -> list[int]:
        """Position of the token in each slot 0 .. size - 1 (-1 for a free slot)."""
        return [-1 if row is None else row.position for row in self._by_slot]

    def scores(self) -> list[float]:
        """Gate score of the token in each slot (nan for a free slot)."""
        return [float("nan") if row is None or row.score is None else row.score for row in self._by_slot]

    def kinds(self) -> list[str]:
        """'sink', 'window' or 'memory' per slot ('free' for a free slot)."""
        kind: dict[int, str] = {}
        for row in self._sink_rows:
            kind[id(row)] = "sink"
        for row in self._window:
            kind[id(row)] = "window"
        for _, _, row in self._memory:
            kind[id(row)] = "memory"
        return ["free" if row is None else kind[id(row)] for row in self._by_slot]
