"""One model forward for several sequences, each over its own cache.

The weights are what a decode forward reads (on a CPU and on a GPU alike), so feeding the
new tokens of B sequences together costs little more than feeding one. The sequences' tokens
are packed into one row of the batch ([1, tokens]: no padding), each at its own RoPE
positions; every layer's projections and MLP run once over all of them. Only attention is
per sequence: `BatchCache` hands each sequence's new K/V to that sequence's own cache (which
writes them where it would alone: appended, or into the rows its `fill` opened) and gives
the attention function a `Ragged`, so each sequence's queries read its own rows under its
own mask. No sequence's rows are copied for it.

    results = forward_many(lm, [prepare(lm, cache_a, ...), prepare(lm, cache_b, ...)])
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..models import attention
from ..models.lean import logits_of
from .forward import FEEDING, ForwardResult, Prepared, recording


class BatchLayer(CacheLayerMixin):
    """Layer `index` of every sequence's cache, for one batched forward."""

    is_sliding = False
    is_compileable = False

    def __init__(self, parts: list[Prepared], runs: list[tuple[int, int]], index: int):
        self.parts, self.runs, self.index = parts, runs, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing: the sequences' own caches hold the rows."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """New rows [1, kv_heads, tokens, head_dim] of every sequence, packed -> each run to its
        own cache; returns the Ragged that attention reads (as keys and as values)."""
        parts = []
        for part, (first, count) in zip(self.parts, self.runs):
            keys, values = part.cache.update(key_states[:, :, first : first + count],
                                             value_states[:, :, first : first + count], self.index)
            parts.append((first, count, keys, values, part.mask))
        ragged = attention.Ragged(tuple(parts))
        return ragged, ragged

    def get_seq_length(self) -> int:
        return 0  # never asked: the forward gives positions and a mask

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


class BatchCache(Cache):
    """The cache a batched forward runs over: each layer a `BatchLayer` over the sequences'
    own caches (`parts`, in the order their tokens are packed)."""

    def __init__(self, parts: list[Prepared], num_layers: int):
        runs, first = [], 0
        for part in parts:
            runs.append((first, len(part.token_ids)))
            first += len(part.token_ids)
        self.runs = runs
        super().__init__(layers=[BatchLayer(parts, runs, index) for index in range(num_layers)])


SHARED_PREFILL_CHUNK = 64  # a prompt's tokens one batched forward carries beside the others' ticks


def shareable(cache, probes) -> bool:
    """Whether a forward over `cache` (with `probes`) can ride in a batched forward: probes
    and the ring store run in a forward of their own (`forward_many` refuses them)."""
    return not probes and getattr(cache, "store", "splice") != "ring"


@torch.no_grad()
def forward_many(lm, parts: list[Prepared]) -> list[ForwardResult]:
    """One forward over every `prepare`d part, their tokens packed in this order. Returns each part's ForwardResult, as `forward` would
    have alone. Probes and the ring store are refused (their scratch rows and slot order are
    one sequence's); a part whose cache is filling rows writes into those rows."""
    if not parts:
        raise ValueError("a batched forward needs at least one sequence")
    first = 0
    for number, part in enumerate(parts):
        if part.probes:
            raise ValueError(f"sequence {number}: probes ride only in a forward of their own sequence")
        if getattr(part.cache, "store", "splice") == "ring":
            raise ValueError(f"sequence {number}: the ring store lays rows out by slot; it runs in a forward of its "
                             "own (batched: the splice store)")
        part.place(first)
        first += len(part.token_ids)
    cache = BatchCache(parts, len(parts[0].cache.layers))
    token_ids = torch.tensor([[t for part in parts for t in part.token_ids]], dtype=torch.long, device=lm.device)
    positions = torch.cat([part.query for part in parts])[None]
    # a mask the model passes on untouched (each sequence's own is in the Ragged)
    unused = torch.zeros((1, 1, token_ids.shape[1], 1), dtype=lm.dtype, device=lm.device)
    feeding = FEEDING.set(frozenset(id(part.cache) for part in parts))
    try:
        with recording([part.recorder for part in parts]):
            logits = logits_of(lm.model, token_ids, positions, cache, unused)
    finally:
        FEEDING.reset(feeding)
    results = []
    for part, (start, count) in zip(parts, cache.runs):
        if part.recorder.layers:
            part.recorder.finish(part.cache)
        results.append(part.result(logits[0, start : start + count]))
    return results
