"""Which cache slot holds which token, in every layer of a SmartKVCache (pure Python and numpy).

Each layer has `sinks + budget + window` slots. Every layer admits the same tokens, in order;
a token enters with its position and a gate score per layer:

- position < sinks: a **sink**, kept for good (the same slot in every layer);
- otherwise it joins the **window**, a FIFO of the `window` most recent non-sink tokens (held
  by every layer). When the window overflows, its oldest token leaves and competes, in each
  layer with that layer's score, for the layer's **long-term memory** of at most `budget`
  tokens: it goes in if there is room or if it outranks the weakest token there (which is then
  evicted from that layer); otherwise that layer drops it.

Rank: the gate predicts a token's whole lifespan, log4(1 + later steps that attend to it)
over a horizon of `horizon` steps (labels.py), and the score a token enters with adds log4 of
its value norm (cache.py, `value_log_norms`), so 4 ** score is its predicted uses times what
each use adds to the attention output. What matters at step `now` is the part still ahead. A
token at `position` has lived `now - position` steps of its horizon, so memory keeps the
tokens with the most predicted lifespan left:

    rank = 4 ** score * max(FLOOR, 1 - (now - position) / horizon)

(`Memories`; ties: the older token goes). `now` is the position of the token whose arrival
pushes the candidate out of the window (candidate position + window). Ranks change as `now`
moves, so the weakest token is found afresh at every offer: one vectorised minimum over
[layers, budget], the same routine the brain's policy runs.

Slots: until a layer is full every token takes the next slot (the same in every layer); after
that each offer frees exactly one slot per layer (the loser's) and the arriving token takes it,
so every layer holds the same number of rows whatever its gate chose (rectangular caches),
though not in the same slots. A prompt admitted at once goes through the same offers in
position order, so the bulk prune after a prefill keeps what admitting the prompt token by
token keeps.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

import numpy as np

FLOOR = 1e-3  # a token past its horizon keeps a thousandth of its predicted lifespan: it goes first
HELD = 1e300  # the rank of a token held after recall took it back: above any rank, below "never" (inf)


class Memories:
    """The long-term memories of `layers` layers, at most `size` tokens each. Every token offered
    competes in every layer at once, with a score per layer, so all layers always hold the same
    count. Arrays [layers, size + 1] by slot (float64): `scores`, `weights` (4 ** score, kept
    so that an offer takes no power of every held score), `positions` and `ids` (int64, the
    caller's name for the token); the last column holds the token being offered."""

    def __init__(self, layers: int, size: int, horizon: int):
        if size < 1 or horizon < 1:
            raise ValueError(f"a memory needs size >= 1 and horizon >= 1, got {size}, {horizon}")
        self.size, self.horizon, self.count = size, horizon, 0
        self.weights, self.positions, self.scores = (np.zeros((layers, size + 1)) for _ in range(3))
        self.ids = np.zeros((layers, size + 1), dtype=np.int64)
        self.until = np.zeros((layers, size + 1))  # a token taken back is not dropped before this step
        self._layers = np.arange(layers)

    watches = False  # whether the policy feeds it each tick's attention (`RecentMemories.attend`)

    NAMES = ("weights", "positions", "scores", "ids", "until")

    @property
    def layers(self) -> int:
        return self.ids.shape[0]

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, name) for name in self.NAMES)

    def _ranks(self, now: int, slots: slice, layers: slice | int = slice(None)) -> np.ndarray:
        """[layers, slots] (or [slots] for one layer) each token's rank at step `now` (see the
        module docstring); a token held (taken back less than its hold ago) ranks above every
        token not held (if all are held, the oldest goes first: their ranks tie)."""
        at = (layers, slots)
        return np.where(self.until[at] > now, HELD, self._unheld_ranks(now, at))

    def _unheld_ranks(self, now: int, at: tuple) -> np.ndarray:
        """The ranks of the tokens at `at` (layers, slots) as if none were held."""
        return self.weights[at] * np.maximum(FLOOR * self.horizon, self.positions[at] - (now - self.horizon))

    def offer(self, token_id, position: int, scores, now: int) -> np.ndarray:
        """Offer a token (its id: one, or one per layer; scores: one per layer) at step `now`.
        Returns int64 [layers]: the id each layer drops, the weakest held or the token itself
        (-1 while the memory has room: nothing is dropped)."""
        column = self.count if self.count < self.size else self.size
        self.until[:, column] = 0
        self.scores[:, column] = scores
        self.weights[:, column] = [4.0 ** float(score) for score in scores]
        self.positions[:, column], self.ids[:, column] = position, token_id
        if column < self.size:
            self.count += 1
            return np.full(self.layers, -1)
        # 4**score * max(FLOOR, 1 - age / horizon), times horizon: the steps of the horizon left
        ranks = self._ranks(now, slice(None))
        at = ranks.argmin(axis=1)
        lowest = ranks[self._layers, at][:, None]
        if (np.count_nonzero(ranks == lowest, axis=1) > 1).any():  # ties: the oldest goes
            at = np.where(ranks == lowest, self.positions, np.inf).argmin(axis=1)
        dropped = self.ids[self._layers, at]
        won = np.flatnonzero(at < self.size)
        for array in self._arrays():
            array[won, at[won]] = array[won, self.size]
        return dropped

    def take_back(self, layer: int, token_ids: list[int], scores: list[float], now: int, hold: int = 0) -> list[int]:
        """Put tokens back into `layer`'s full memory, each in place of its weakest token (not
        one taken back now, nor one still held): recall found them in use, so each is held
        until step `now + hold` (a fact the gates predicted little use for would otherwise be
        the weakest again at the next offer, and leave before the question that called it
        back is answered), then ranks by its own score with a lifespan that started at `now`.
        Returns the ids dropped, one per token."""
        if self.count < self.size:
            raise ValueError("a token comes back only into a full memory (it replaces the weakest)")
        ranks = self._ranks(now, slice(None, self.size), layer)  # one layer's: a restore touches one lane at a time
        dropped = []
        for token_id, score in zip(token_ids, scores):
            at = int(ranks.argmin())
            dropped.append(int(self.ids[layer, at]))
            self.scores[layer, at], self.weights[layer, at] = score, 4.0 ** float(score)
            self.positions[layer, at], self.ids[layer, at], self.until[layer, at] = now, token_id, now + hold
            ranks[at] = np.inf  # the next token taken back does not displace this one
        return dropped

    def shrink(self, now: int) -> np.ndarray:
        """One token less in every layer's memory (a pinned token left the window and stays in
        every layer outside it). Returns int64 [layers]: the id each layer drops, its weakest,
        when the memory was full; -1 while it had room."""
        dropped = np.full(self.layers, -1)
        if self.size < 2:
            raise ValueError("pins would leave no long-term memory")
        if self.count == self.size:
            at = self._ranks(now, slice(None, self.size)).argmin(axis=1)
            dropped = self.ids[self._layers, at].copy()
            for array in self._arrays():
                array[self._layers, at] = array[:, self.size - 1]  # the last held token fills the gap
            self.count -= 1
        self._resize(self.size - 1)
        return dropped

    def remove(self, token_id: int) -> None:
        """Take a token every layer holds out of every memory, which shrinks by one (it was
        pinned: it stays in every layer outside the memory)."""
        at = [np.flatnonzero(self.ids[layer, : self.count] == token_id) for layer in range(self.layers)]
        if any(len(found) != 1 for found in at):
            raise ValueError(f"token {token_id} is not in every layer's memory")
        at = np.array([found[0] for found in at])
        for array in self._arrays():
            array[self._layers, at] = array[:, self.count - 1]
        self.count -= 1
        self._resize(self.size - 1)

    def grow(self) -> None:
        """Room for one more token in every memory (an unpinned token competes again)."""
        self._resize(self.size + 1)

    def _resize(self, size: int) -> None:
        if size < 1:
            raise ValueError("pins would leave no long-term memory")
        for name in self.NAMES:
            array = getattr(self, name)
            resized = np.zeros((self.layers, size + 1), dtype=array.dtype)
            resized[:, : self.count] = array[:, : self.count]
            setattr(self, name, resized)
        self.size = size

    def copy(self) -> "Memories":
        """A twin whose arrays are copies (a tick's plan edits a twin: copied, not built anew
        from zeros)."""
        twin = copy.copy(self)
        for name in self.NAMES:
            setattr(twin, name, getattr(self, name).copy())
        return twin

    def held_ids(self) -> list[int]:
        return self.ids[:, : self.count].ravel().tolist()

    def entries(self) -> list[list[list]]:
        """Per layer, [score, position, id] of every token held, by slot (a session's record),
        and a 4th item, the step it is held until, for a token taken back and still held."""
        held = slice(0, self.count)
        columns = (self.scores[:, held].tolist(), *(getattr(self, name)[:, held].astype(np.int64).tolist()
                                                    for name in ("positions", "ids", "until")))
        return [[[score, position, token_id] + ([until] if until else [])
                 for score, position, token_id, until in zip(*layer)] for layer in zip(*columns)]

    @classmethod
    def from_entries(cls, entries: list[list], size: int, horizon: int) -> "Memories":
        """From `entries()` (every layer the same count, at most `size`)."""
        memory = cls(len(entries), size, horizon)
        for layer, held in enumerate(entries):
            for slot, (score, position, token_id, *until) in enumerate(held):
                memory.scores[layer, slot], memory.weights[layer, slot] = float(score), 4.0 ** float(score)
                memory.positions[layer, slot] = position
                memory.ids[layer, slot] = token_id
                memory.until[layer, slot] = until[0] if until else 0
        memory.count = len(entries[0]) if entries else 0
        return memory


@dataclass(slots=True)
class Entry:
    """A window token: its position, its slot in each layer (int64 [layers]) and its gate score
    in each layer (float [layers]; None until scored: a window token needs scores only when
    it leaves the window)."""

    position: int
    slots: np.ndarray
    scores: np.ndarray | None = None


class RowBook:
    """Slot bookkeeping of every layer (see the module docstring)."""

    def __init__(self, layers: int, sinks: int, budget: int, window: int, horizon: int = 512):
        if layers < 1 or min(sinks, budget) < 0 or window < 1:
            raise ValueError(f"a RowBook needs layers >= 1, sinks >= 0, budget >= 0 and window >= 1 (the newest "
                             f"token), got {layers}, {sinks}, {budget}, {window}")
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.layers, self.sinks, self.budget, self.window_size, self.horizon = layers, sinks, budget, window, horizon
        self.capacity = sinks + budget + window
        self.size = 0                          # slots used in each layer (grows to capacity, then stays)
        self.slot_positions = np.full((layers, self.capacity), -1, dtype=np.int64)  # position held per slot
        self._window: deque[Entry] = deque()   # oldest first
        self._memory = Memories(layers, budget, horizon) if budget else None  # ids: the token's slot per layer
        self._all = np.arange(layers)

    # --- admission -------------------------------------------------------------------------

    def admit(self, positions: list[int], scores: np.ndarray | None) -> np.ndarray:
        """Admit tokens at consecutive `positions`, in order, with `scores` float [layers, q]
        (None: not scored yet; see `unscored`). Returns int64 [layers, q]: the slot where each
        token is held at the end in each layer, -1 where it is not: the caller writes token i's
        K/V of layer l into slots[l, i]. Slots not named keep what they held. A token that
        leaves the window unscored is a RuntimeError."""
        if positions and positions != list(range(positions[0], positions[0] + len(positions))):
            raise ValueError("a RowBook admits consecutive positions")
        for i, position in enumerate(positions):
            self._admit(int(position), None if scores is None else scores[:, i])
        slots = np.full((self.layers, len(positions)), -1, dtype=np.int64)
        if positions:
            index = self.slot_positions[:, : self.size] - positions[0]
            layer, slot = np.nonzero(index >= 0)
            slots[layer, index[layer, slot]] = slot
        return slots

    def _admit(self, position: int, scores: np.ndarray | None) -> None:
        if position < self.sinks:
            self._place(position, np.full(self.layers, self.size))
            return
        entry = Entry(position, np.full(self.layers, -1), scores)
        self._window.append(entry)
        freed = self._offer(self._window.popleft()) if len(self._window) > self.window_size else None
        entry.slots = np.full(self.layers, self.size) if freed is None else freed
        self._place(position, entry.slots)

    def _offer(self, entry: Entry) -> np.ndarray | None:
        """`entry` has left the window: into each layer's long-term memory, or gone from that
        layer. Returns the slot this freed in each layer (None: nothing freed, the memory had room)."""
        if self._memory is None:
            return entry.slots
        if entry.scores is None:
            raise RuntimeError(f"the token at position {entry.position} left the window unscored")
        dropped = self._memory.offer(entry.slots, entry.position, entry.scores,
                                        now=entry.position + self.window_size)
        return None if dropped[0] < 0 else dropped

    def _place(self, position: int, slots: np.ndarray) -> None:
        if slots[0] == self.size:
            if self.size >= self.capacity:  # cannot happen: sinks, window and memory are each bounded
                raise RuntimeError("no free slot")
            self.size += 1
        self.slot_positions[self._all, slots] = position

    # --- lazy scores -------------------------------------------------------------------------

    def unscored(self, arriving: int) -> list[Entry]:
        """The window's unscored tokens, oldest first, if `arriving` more non-sink tokens would
        push one of them out of the window (and long-term memory would need its scores); else
        []. Every unscored window token is returned then, so scores come in batches."""
        if self._memory is None:
            return []
        leaving = len(self._window) + arriving - self.window_size
        if leaving <= 0 or all(self._window[k].scores is not None for k in range(min(leaving, len(self._window)))):
            return []
        return [entry for entry in self._window if entry.scores is None]

    @staticmethod
    def set_scores(entries: list[Entry], scores: np.ndarray) -> None:
        """scores: float [layers, len(entries)]."""
        for k, entry in enumerate(entries):
            entry.scores = scores[:, k].copy()

    # --- facts -----------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Tokens each layer holds."""
        return self.size

    def positions(self, layer: int) -> list[int]:
        """Position of the token in each slot 0 .. size - 1 of `layer`."""
        return self.slot_positions[layer, : self.size].tolist()

    def kinds(self, layer: int) -> list[str]:
        """'sink', 'window' or 'memory' per slot of `layer`."""
        window = {entry.position for entry in self._window}
        return ["sink" if p < self.sinks else "window" if p in window else "memory" for p in self.positions(layer)]
