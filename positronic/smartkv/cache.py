"""SmartKVCache: a transformers Cache whose layers each keep their own most useful rows.

    gates = GateSet.for_model("smollm2")
    cache = SmartKVCache(model.config, gates, sinks=4, budget=96, window=32)
    model.generate(ids, **with_cache(cache), max_new_tokens=64)      # prunes as it goes

    cache = SmartKVCache(model.config, gates, budget=96, prune="manual")
    model(ids[:, :-1], **with_cache(cache))    # prefill: every row kept
    cache.bulk_prune()                           # down to sinks + budget + window, once
    model.generate(ids, **with_cache(cache), max_new_tokens=64)      # streaming prune

Layout (per layer, rows.py): `sinks + budget + window` slots; sinks (positions < sinks) kept
for good, a FIFO window of the most recent tokens, and a long-term memory of `budget` tokens
that left the window, ranked by the lifespan their gate score predicts is still ahead of them
times the norm of their value row (rows.py; `value_norms`). Each layer scores with
its own gate, so layers keep different tokens, but every layer admits the same tokens and
drops one row per new row once full, so all layers always hold the same number of rows
(rectangular: `rows`).

Lanes: the RowBook's unit. With per-layer gates a lane is a layer: all its kv heads keep
the same tokens. With per-head gates (the shipped ones; `GateSet.heads` = kv heads) a lane is one
kv head of one layer, lane = layer * kv_heads + head: each kv head keeps its own tokens, and
every head still holds the same number of rows (keys are stored rotated, so attention needs
nothing else).

Positions. Keys are stored as the model wrote them: rotated at their own positions, never
moved. What changes after pruning is that the row count no longer equals the number of
tokens seen, and transformers derives positions from the cache:
- `get_seq_length()` returns the tokens seen (`seen`), not the rows: Llama's forward uses it
  as the first new position when no position_ids are given, `generate` uses it to find the
  not-yet-cached part of input_ids and counts position_ids from the attention mask or from
  it, and the mask code uses it as the query offset (`get_query_offset`);
- `get_mask_sizes(q)` returns (n, seen + q - n), n the rows `update` will return: they are
  treated as the n positions ending with the new tokens, so every query sees every stored
  row and the new tokens causally (a 2-D attention mask of length seen + q is read at its
  last n entries, all ones for an unpadded sequence). This is the offset arithmetic
  transformers' own sliding-window layer uses.
A decoded token (one per forward) is admitted first and attends to the rows held then,
itself included: at most `capacity` rows, read in place from the buffers. A forward of q > 1
tokens (a prefill) attends over the stored rows plus all q new ones, and the layout is
applied after it. Between forwards a layer holds at most `capacity` rows. One sequence
(batch 1), unpadded; no beam search, no crop.

Scores: a key is un-rotated (RoPE position -> 0, exact in float32) and given to the layer's
gate: the gates were trained on pre-RoPE keys (labels.py), so the score says what the token
is, not where it sits. To the gate's predicted log4 lifespan the score adds log4 of the
token's value norm (`value_log_norms`): what a row adds to the attention output is its weight
times its value, and the labels count weights only. A prefill's tokens are scored at once; a
decoded token is scored only when long-term memory needs its score, i.e. when it is about to
leave the window, together with every other unscored window row (one batched gate call per
layer every `window` tokens).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache

from ..kv.cache import OneSequenceLayer
from .gates import GateSet, kv_heads
from .labels import KeyUnrotator, LifespanRule
from .rows import RowBook

PRUNE_MODES = ("auto", "manual")
LOG4 = float(np.log(4.0))


def value_log_norms(values: torch.Tensor, lanes: int) -> torch.Tensor:
    """log4 of the value norms of rows `values` [kv_heads, n, head_dim]: float32 [n, lanes], one
    column per kv head (lanes = kv heads) or, for one lane per layer, of the mean norm over the
    kv heads. Added to a gate score, it makes memory rank a token by its predicted uses times
    the size of what each use adds to the output (bench/results/history/smartkv.md, "value norms
    in the rank")."""
    norms = values.to(torch.float32).norm(dim=-1)  # [kv_heads, n]
    if lanes == 1:
        norms = norms.mean(0, keepdim=True)
    return (norms.clamp_min(1e-12).log() / LOG4).T


class Layout:
    """What the layers of a SmartKVCache share: the RowBook (every layer's slots), the scorer, and
    each new token's admission, done once for all layers.

    A decoded token is admitted when the first layer asks for its slot (`decode_slots`), with
    the waiting window tokens scored first if it pushes one out (their keys are in every
    layer's buffer by then). A forward of several tokens is admitted after the last layer has
    scored its keys (`take_batch`): until then each layer keeps its new rows aside."""

    def __init__(self, book: RowBook, scorer, unrotator: KeyUnrotator, pruning: bool, heads: int = 1,
                 value_norms: bool = True):
        self.book, self.scorer, self.unrotator, self.pruning = book, scorer, unrotator, pruning
        self.heads = heads  # lanes per layer: 1, or the kv heads (per-head gates)
        self.value_norms = value_norms  # scores add log4 of each row's value norm
        self.layers: list[SmartKVLayer] = []
        self._decoded: tuple[int, torch.Tensor | None] = (-1, None)  # position, its slot per lane

    def lanes(self, layer: int) -> slice:
        """The RowBook lanes of `layer`."""
        return slice(layer * self.heads, (layer + 1) * self.heads)

    def score(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> np.ndarray:
        """Scores float [heads, q] of rows keys, values [1, kv_heads, q, head_dim] (keys rotated
        at `positions` [q]): the scorer's (a scorer may return [q] or [q, heads]), plus log4 of
        the value norms with `value_norms`."""
        count = keys.shape[2]
        if self.scorer is None:
            return np.zeros((self.heads, count))
        plain = self.unrotator(keys, positions)  # [q, kv_heads * head_dim]
        scores = self.scorer.score(layer, plain, positions).float().reshape(count, -1)
        if self.value_norms:
            scores = scores + value_log_norms(values[0], self.heads).to(scores.device)
        return scores.cpu().numpy().astype(np.float64).T

    def decode_slots(self, position: int, device) -> torch.Tensor:
        """int64 [lanes] on `device`: the slot of the token at `position` in each lane
        (admitted on the first call for a position)."""
        if self._decoded[0] != position:
            self._score_waiting(arriving=int(position >= self.book.sinks))
            slots = self.book.admit([position], None)[:, 0]
            self._decoded = (position, torch.from_numpy(slots).to(device))
        return self._decoded[1]

    def take_batch(self, positions: list[int]) -> None:
        """The last layer has its new rows: admit them all (scores from every layer) and let each
        layer write the ones it keeps."""
        scores = np.concatenate([layer.fresh[2] for layer in self.layers])  # [lanes, q]
        self._score_waiting(arriving=sum(p >= self.book.sinks for p in positions))
        slots = self.book.admit(positions, scores)
        for layer in self.layers:
            layer.write_fresh(slots[self.lanes(layer.index)])

    def bulk_prune(self) -> None:
        """Manual mode's end: admit every row held so far (positions 0 .. seen - 1, in order)."""
        self.pruning = True
        if not self.layers[0].is_initialized:
            return
        scores = np.concatenate([np.concatenate(layer.pending_scores, axis=1) for layer in self.layers])
        slots = self.book.admit(list(range(self.layers[0].seen)), scores)  # [lanes, seen]
        for layer in self.layers:
            layer.compact(slots[self.lanes(layer.index)])

    def _score_waiting(self, arriving: int) -> None:
        """Score the window's unscored tokens in every layer (rows read from each layer's buffer)
        if `arriving` tokens would push one of them out."""
        waiting = self.book.unscored(arriving)
        if waiting:
            positions = torch.tensor([entry.position for entry in waiting])
            slots = np.stack([entry.slots for entry in waiting], axis=1)  # [lanes, n]
            scores = np.concatenate([self.score(layer.index, *layer.read(slots[self.lanes(layer.index)]), positions)
                                     for layer in self.layers])
            self.book.set_scores(waiting, scores)


class SmartKVLayer(OneSequenceLayer):
    """One layer's rows: storage [1, kv_heads, rows, head_dim] (keys and values) whose slot i holds
    the token the shared book says this layer's lane holds in slot i (per-head lanes: kv head
    h's slot i holds what lane h of this layer holds there).

    Not pruning (manual mode before `bulk_prune`): rows are appended in order and kept, with
    their scores. Pruning: rows live in a preallocated [1, kv_heads, capacity, head_dim]
    buffer and each new token is written into the slot the layout names.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    cache_name = "SmartKVCache"

    def __init__(self, index: int, layout: Layout):
        super().__init__()
        self.index, self.layout = index, layout
        self.seen = 0                 # tokens that went through update: the next token's position
        self.rows = 0
        self._key_buffer = self._value_buffer = None
        self.pending_scores: list[np.ndarray] = []  # not pruning: scores of the rows kept so far
        self.fresh: tuple | None = None  # a multi-token forward's (keys, values, scores) until the layout takes it

    # --- what transformers calls ---------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError(f"SmartKVCache holds one sequence (each keeps its own rows); got a batch of "
                             f"{key_states.shape[0]}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0].clone()
        self.values = value_states[:, :, :0].clone()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take q new rows [1, kv_heads, q, head_dim] (keys rotated at positions seen .. seen + q - 1)
        and return the keys and values this forward attends to, [1, kv_heads, n, head_dim] each.

        One token while pruning (decoding): it is admitted first and the forward attends to
        the rows held afterwards, itself included (n <= capacity), read in place. Several
        tokens (a prefill): they must see each other causally, so the forward attends to the
        stored rows followed by all q new ones (n = rows + q, one concatenated copy), and the
        layout is applied after the last layer."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise ValueError(f"SmartKVCache holds one sequence; got a batch of {key_states.shape[0]}")
        count = key_states.shape[2]
        if self.layout.pruning and count == 1:
            slots = self.layout.decode_slots(self.seen, key_states.device)[self.layout.lanes(self.index)]
            self._ensure_buffers()
            if len(slots) == 1:  # one lane: every head writes the same slot
                self._key_buffer.index_copy_(2, slots, key_states)
                self._value_buffer.index_copy_(2, slots, value_states)
            else:
                heads = torch.arange(len(slots), device=slots.device)
                self._key_buffer[0, heads, slots] = key_states[0, :, 0]
                self._value_buffer[0, heads, slots] = value_states[0, :, 0]
            self._expose(self.layout.book.size)
            self.seen += 1
            return self.keys, self.values
        positions = torch.arange(self.seen, self.seen + count)
        scores = self.layout.score(self.index, key_states, value_states, positions)
        keys = torch.cat([self.keys, key_states], dim=2)
        values = torch.cat([self.values, value_states], dim=2)
        self.seen += count
        if self.layout.pruning:
            self.fresh = (key_states, value_states, scores)
            if self.index == len(self.layout.layers) - 1:
                self.layout.take_batch(positions.tolist())
        else:
            self.keys, self.values, self.rows = keys, values, keys.shape[2]
            self.pending_scores.append(scores)
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen, not rows held: the position the next token takes."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(n, seen + q - n), n the rows `update` will return: the rows attended to stand for
        the positions just before the new tokens (a decoded token is admitted first, so n is
        what is held after it: at most the capacity)."""
        if self.layout.pruning and query_length == 1:
            attended = min(self.layout.book.capacity, self.rows + 1)
        else:
            attended = self.rows + query_length
        return attended, self.seen + query_length - attended

    def reset(self) -> None:
        raise NotImplementedError("reset the whole SmartKVCache (SmartKVCache.reset), not one layer")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("SmartKVCache cannot be cropped: the rows it dropped cannot come back")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("SmartKVCache holds one sequence")

    # --- what the layout calls -------------------------------------------------------------------

    def _heads_of(self, lanes: int) -> list[slice]:
        """The kv heads of each of this layer's `lanes` lanes (one lane: all of them)."""
        return [slice(None)] if lanes == 1 else [slice(h, h + 1) for h in range(lanes)]

    def read(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values [1, kv_heads, n, head_dim] held in `slots` [lanes, n] (each kv head from
        its lane's slots)."""
        read = []
        for buffer in (self._key_buffer, self._value_buffer):
            parts = [buffer[:, heads].index_select(2, torch.from_numpy(lane).to(buffer.device))
                     for heads, lane in zip(self._heads_of(len(slots)), slots)]
            read.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
        keys, values = read
        return keys, values

    def write_fresh(self, slots: np.ndarray) -> None:
        """Write the kept rows of the forward's new tokens (slots [lanes, q], -1: not kept)."""
        keys, values, _ = self.fresh
        self.fresh = None
        self._ensure_buffers()
        for heads, lane in zip(self._heads_of(len(slots)), slots):
            kept = np.flatnonzero(lane >= 0)
            if len(kept):
                rows = torch.from_numpy(kept).to(keys.device)
                where = torch.from_numpy(lane[kept]).to(keys.device)
                self._key_buffer[:, heads].index_copy_(2, where, keys[:, heads].index_select(2, rows))
                self._value_buffer[:, heads].index_copy_(2, where, values[:, heads].index_select(2, rows))
        self._expose(self.layout.book.size)

    def compact(self, slots: np.ndarray) -> None:
        """bulk_prune: move the appended rows (slots [lanes, rows], -1: dropped) into the buffer."""
        self.pending_scores = []
        size = self.layout.book.size
        moved = []
        for heads, lane in zip(self._heads_of(len(slots)), slots):
            order = torch.empty(size, dtype=torch.long)
            kept = np.flatnonzero(lane >= 0)
            order[torch.from_numpy(lane[kept])] = torch.from_numpy(kept)
            order = order.to(self.keys.device)
            moved.append((heads, self.keys[:, heads].index_select(2, order), self.values[:, heads].index_select(2, order)))
        self._allocate()
        for heads, kept_keys, kept_values in moved:
            self._key_buffer[:, heads, :size].copy_(kept_keys)
            self._value_buffer[:, heads, :size].copy_(kept_values)
        self._expose(size)

    # --- storage ---------------------------------------------------------------------------------

    def _ensure_buffers(self) -> None:
        if self._key_buffer is None:
            self._allocate()
            self._key_buffer[:, :, : self.rows].copy_(self.keys)
            self._value_buffer[:, :, : self.rows].copy_(self.values)

    def _allocate(self) -> None:
        shape = (1, self.keys.shape[1], self.layout.book.capacity, self.keys.shape[3])
        self._key_buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._value_buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _expose(self, rows: int) -> None:
        """keys / values: views of the buffers' first `rows` slots (what the next forward reads)."""
        self.rows = rows
        self.keys = self._key_buffer[:, :, :rows]
        self.values = self._value_buffer[:, :, :rows]

    # --- facts ---------------------------------------------------------------------------------

    def positions(self, head: int = 0) -> torch.Tensor:
        """int64 [rows]: the RoPE position of the token in each stored row of kv head `head` (the
        same in every head unless the gates are per head)."""
        if not self.layout.pruning:
            return torch.arange(self.rows)
        lanes = self.layout.lanes(self.index)
        return torch.tensor(self.layout.book.positions(lanes.start + (head if self.layout.heads > 1 else 0)),
                            dtype=torch.long)

    def memory_bytes(self) -> int:
        if self._key_buffer is not None:
            return 2 * self._key_buffer.numel() * self._key_buffer.element_size()
        return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()


class GateScorer:
    """Adapts a GateSet to the scorer interface: score(layer, keys [q, in_dim], positions [q]) -> [q, heads]."""

    def __init__(self, gates: GateSet):
        self.gates = gates
        self.heads = gates.heads

    def score(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.gates.score(layer, keys)


class SmartKVCache(Cache):
    """A transformers Cache of SmartKVLayers (see the module docstring).

    config: the model's (Llama) config. gates: a GateSet for it (required when budget > 0;
    per-head gates keep rows per kv head), or `scorer`: any object with score(layer, keys
    [q, kv_heads * head_dim] pre-RoPE, positions [q]) -> [q] or [q, heads], and optionally
    `heads` (1 or the kv heads; default 1) (tests use position-only scorers). window: the recent rows kept
    (default sinks + budget: half the capacity, as `--policy smartkv` does). horizon: the steps a score's
    lifespan counts over, which long-term memory ranks by (rows.py; default: the gates' own,
    else 512). value_norms: scores add log4 of each row's value norm (False: memory ranks by the
    gates' predicted lifespan alone, the ablation). prune: "auto" (prune in every
    update, so a prefill is bulk-pruned right after its forward) or "manual" (keep every row
    until `bulk_prune()`, then prune as tokens arrive).
    """

    def __init__(self, config, gates: GateSet | None = None, *, budget: int, sinks: int = 4, window: int | None = None,
                 prune: str = "auto", scorer=None, horizon: int | None = None, value_norms: bool = True):
        if prune not in PRUNE_MODES:
            raise ValueError(f"prune must be one of {PRUNE_MODES}, got {prune!r}")
        if gates is not None and scorer is not None:
            raise ValueError("give gates or a scorer, not both")
        if gates is not None:
            gates.check_model(config)
            scorer = GateScorer(gates)
        if budget > 0 and scorer is None:
            raise ValueError(f"a long-term budget ({budget}) needs gates to rank tokens; use budget=0 for a "
                             "streaming cache (sinks + window)")
        if window is None:
            if budget == 0:
                raise ValueError("a cache without long-term memory (budget 0) needs its window size: "
                                 "give window=, or use SmartKVCache.streaming(config, capacity=...)")
            window = sinks + budget
        self.sinks, self.budget, self.window = sinks, budget, window
        self.horizon = horizon or (gates.horizon if gates is not None else LifespanRule.horizon)
        self.prune = prune
        self.gates = gates
        heads = getattr(scorer, "heads", 1)
        if heads not in (1, kv_heads(config)):
            raise ValueError(f"a scorer scores 1 lane per layer or one per kv head ({kv_heads(config)}), not {heads}")
        book = RowBook(config.num_hidden_layers * heads, sinks, budget, window, self.horizon)
        self.layout = Layout(book, scorer, KeyUnrotator.for_config(config), pruning=prune == "auto", heads=heads,
                             value_norms=value_norms)
        self.layout.layers = [SmartKVLayer(i, self.layout) for i in range(config.num_hidden_layers)]
        super().__init__(layers=self.layout.layers)
        self._config = config
        self._scorer = scorer

    @staticmethod
    def streaming(config, *, capacity: int, sinks: int = 4) -> "SmartKVCache":
        """The baseline: sinks + a recent window, `capacity` rows in all (no gates, no long-term memory)."""
        return SmartKVCache(config, None, budget=0, sinks=sinks, window=capacity - sinks)

    @property
    def capacity(self) -> int:
        return self.sinks + self.budget + self.window

    @property
    def rows(self) -> int:
        """Rows each layer holds (the same in every layer)."""
        return self.layers[0].rows

    @property
    def seen(self) -> int:
        """Tokens that went through the cache (the next token's position)."""
        return self.layers[0].seen

    def bulk_prune(self) -> None:
        """Manual mode: compress every layer to its layout once (after the prefill); from then on
        every update prunes. A no-op once pruning is on (always, in auto mode)."""
        if not self.layout.pruning:
            self.layout.bulk_prune()

    def positions(self, layer: int, head: int = 0) -> torch.Tensor:
        """int64 [rows]: the RoPE position of each stored row of `layer` (kv head `head`: with
        per-head gates each kv head keeps its own rows), in storage order."""
        return self.layers[layer].positions(head)

    def reset(self) -> None:
        """Forget every row and token (same settings)."""
        fresh = SmartKVCache(self._config, budget=self.budget, sinks=self.sinks, window=self.window,
                             prune=self.prune, scorer=self._scorer, horizon=self.horizon,
                             value_norms=self.layout.value_norms)
        self.layout, self.layers = fresh.layout, fresh.layers

    def memory_bytes(self) -> int:
        return sum(layer.memory_bytes() for layer in self.layers)
