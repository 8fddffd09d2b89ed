"""The attention functions the loaded models run, and the tap that reads each layer's query
and keys as the model itself computed them.

On a CPU: PyTorch's scaled_dot_product_attention with grouped-query attention kept even when a
mask is given. transformers' own "sdpa" path passes `enable_gqa` to SDPA only when there is no
mask (its CUDA kernels fall back to the slow path with both); with a mask it first copies every
key and value head `heads / kv_heads` times (`repeat_kv`). On a CPU, PyTorch's kernels take
both, and the copy is what a masked forward pays: for SmolLM2 (9 query heads on 3 kv heads) a
masked tick over 1,024 rows costs ~1 ms more. On a GPU: transformers' own "sdpa" function,
called unchanged. Same arithmetic either way (tests compare logits with plain transformers).

A batched forward (positronic.batch) feeds several sequences' tokens in one run, each over its
own cache: there a layer's "keys" are a `Ragged`, and each sequence's queries attend to its own
rows with its own mask, through the same function.

Both are registered under names of their own so that one `Tap` can read what every family's
attention module hands its attention function: the query and keys after the family's own
projections (fused qkv, biases), norms (Qwen3's q/k RMSNorm) and RoPE. The brain's attention
row and SmartKV's labels read them there, so no code here re-implements any family's attention.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION = "positronic_sdpa"  # CPU: grouped SDPA under a mask too
ATTENTION_CUDA = "positronic_sdpa_cuda"  # GPU: transformers' "sdpa", with the tap

# (module, query [batch, heads, q, head_dim], key / value [batch, kv_heads, k, head_dim], scaling)
TapFunction = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, float], None]
# (module, log_norm [batch, heads, q] float32): each query's log Σ exp(scaled logits) over the rows it attends
NormFunction = Callable[[torch.nn.Module, torch.Tensor], None]
_TAP: contextvars.ContextVar[tuple[frozenset[int] | None, TapFunction, NormFunction | None] | None] = \
    contextvars.ContextVar("positronic_attention_tap", default=None)


@contextlib.contextmanager
def tap(function: TapFunction, layers=None, norms: NormFunction | None = None):
    """While active, every forward calls `function(module, query, key, value, scaling)` in each
    attention layer whose `layer_idx` is in `layers` (None: every layer), before attending.
    query and keys are post-RoPE, as the model attends with them; key/value hold every row the
    layer attends over (the cache's and the new ones).

    `norms(module, log_norm)`, if given, is called after attending where the kernel computes
    the normaliser anyway (the CPU's fused SDPA), so nobody reads the keys again for it; where
    it does not (a GPU, a boolean mask), it is not called."""
    token = _TAP.set((None if layers is None else frozenset(layers), function, norms))
    try:
        yield
    finally:
        _TAP.reset(token)


def _tapped(module):
    """The active tap if it covers this layer, else None."""
    active = _TAP.get()
    if active is not None and (active[0] is None or module.layer_idx in active[0]):
        return active
    return None


def _see(module, query, key, value, scaling):
    """Call the tap that covers this layer, if any; returns it (None: no tap here)."""
    if (active := _tapped(module)) is not None:
        active[1](module, query, key, value, module.scaling if scaling is None else scaling)
    return active


@dataclass(frozen=True)
class Ragged:
    """One layer's keys and values in a batched forward: per sequence, the run of the packed
    queries that is its tokens (first, count), its cache's rows (keys, values
    [1, kv_heads, rows, head_dim]) and its mask ([1, 1, count, rows], additive; None: every
    query sees every row)."""

    parts: tuple[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None], ...]


@dataclass(frozen=True)
class Decode:
    """One layer's rows in a Core v4 decode round (positronic/kv/slots.py): every slot's keys and
    values [slots, kv_heads, capacity, head_dim] and the additive mask [slots, 1, 1, capacity]
    that hides the rows past each slot's length."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor


def decode_mask(rows: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """rows [slots] int64 (each slot's newest row) -> the additive mask [slots, 1, 1, capacity]
    of `dtype` that hides every row past it (`Decode.mask`)."""
    hidden = torch.arange(capacity, device=rows.device)[None] > rows[:, None]  # [slots, capacity]
    return torch.zeros(hidden.shape, dtype=dtype, device=rows.device).masked_fill_(hidden, torch.finfo(dtype).min)[:, None, None]


def decode_attention(query: torch.Tensor, rows: Decode, scaling: float,
                     norms: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One new token per slot: query [slots, heads, 1, head_dim] -> output [slots, heads, 1,
    head_dim] and (`norms`) the log-normaliser [slots, heads, 1] float32, else None.

    Written out (grouped product, softmax, product) rather than SDPA's fused kernel: on a CPU
    that kernel splits the rows of a short query among its threads according to how much work
    the whole batch holds, so a slot's output changed in its last bits with the number of other
    slots; these products and row-wise reductions treat every slot and head alike whatever the
    batch (tests/positronic/state/test_slots.py). Per-op overhead is most of its cost at small
    batches, so it is few ops: the query scaled (not the [.., capacity] logits), the mask added
    in place, one softmax where no log-normaliser is wanted (SmolLM2, one slot: 130 µs a layer
    against 240 for logsumexp then exp; the fused kernel 53)."""
    slots, heads, _, head_dim = query.shape
    weights, log_norm = decode_weights(query, rows, scaling, norms)
    out = (weights.to(rows.values.dtype) @ rows.values).reshape(slots, heads, 1, head_dim)
    return out.to(query.dtype), log_norm


def decode_weights(query: torch.Tensor, rows: Decode, scaling: float,
                   norms: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`decode_attention`'s weights: query [slots, heads, 1, head_dim] -> each row's share
    [slots, kv_heads, heads // kv_heads, capacity] float32 and (`norms`) the log-normaliser
    [slots, heads, 1] float32, else None."""
    grouped = _grouped_query(query, rows, scaling)
    logits = (grouped @ rows.keys.transpose(-1, -2).float()).add_(rows.mask)  # [slots, kv, g, capacity]
    if not norms:
        return torch.softmax(logits, dim=-1), None
    return _normalised(logits, query.shape[1])


def traced_decode_attention(query: torch.Tensor, rows: Decode,
                            scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`decode_attention` for a graph inductor compiles for a CPU: query [slots, heads, 1,
    head_dim] -> output [slots, kv_heads, heads // kv_heads, head_dim] of query's dtype, the
    shares [slots, kv_heads, heads // kv_heads, capacity] float32 and the log-normaliser
    [slots, heads, 1] float32. Both products are written as a broadcast product and a sum, so
    that inductor makes each a loop fused with the softmax beside it where `@` would be two
    calls of an external batched product a layer: SmolLM2 int8-weight-only, a round of one,
    93.7 tok/s against 84.7 (with float weights slower: compiled.ROUND_WEIGHTS). Eager it would
    build [slots, kv_heads, group, capacity, head_dim] floats: it is for traced rounds only.
    Every slot and head is the same loop whatever the batch, as with `@`."""
    grouped = _grouped_query(query, rows, scaling)
    logits = (grouped.unsqueeze(-2) * rows.keys.float().unsqueeze(2)).sum(-1).add_(rows.mask)  # [slots, kv, g, capacity]
    weights, log_norm = _normalised(logits, query.shape[1])
    out = (weights.unsqueeze(-1) * rows.values.float().unsqueeze(2)).sum(-2)  # [slots, kv, g, head_dim]
    return out.to(query.dtype), weights, log_norm


def _grouped_query(query: torch.Tensor, rows: Decode, scaling: float) -> torch.Tensor:
    """query [slots, heads, 1, head_dim] -> [slots, kv_heads, heads // kv_heads, head_dim]
    float32, scaled (not the [.., capacity] logits: fewer multiplications)."""
    slots, heads, _, head_dim = query.shape
    kv_heads = rows.keys.shape[1]
    return query.reshape(slots, kv_heads, heads // kv_heads, head_dim).float() * scaling


def _normalised(logits: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [slots, kv_heads, group, capacity] float32, masked (overwritten) -> the shares of
    the same shape and the log-normaliser [slots, heads, 1]."""
    top = logits.amax(dim=-1, keepdim=True)
    weights = logits.sub_(top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return weights.div_(total), (top + total.log()).reshape(logits.shape[0], heads, 1)


def _each(attend, module, query: torch.Tensor, ragged: Ragged, **kwargs) -> tuple[torch.Tensor, None]:
    """Each sequence's queries against its own rows -> [1, queries, heads, head_dim]."""
    return torch.cat([attend(module, query[:, :, first : first + count], keys, values, mask, **kwargs)[0]
                      for first, count, keys, values, mask in ragged.parts], dim=1), None


def grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor | Ragged, value: torch.Tensor | Ragged,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [batch, heads, q, head_dim], key / value [batch, kv_heads, k, head_dim], mask
    broadcastable to [batch, heads, q, k] (additive or boolean) or None -> output
    [batch, q, heads, head_dim] (transformers' attention-function contract; no weights)."""
    active = _see(module, query, key, value, scaling)
    norms = None if active is None else active[2]
    if isinstance(key, Decode):
        out, log_norm = decode_attention(query, key, module.scaling if scaling is None else scaling,
                                         norms=norms is not None)
    elif isinstance(key, Ragged):
        outs, log_norms = zip(*(_grouped(module, query[:, :, first : first + count], keys, values, mask,
                                         dropout=dropout, scaling=scaling, norms=norms is not None)
                                for first, count, keys, values, mask in key.parts))
        out = torch.cat(outs, dim=2)  # the sequences' queries in packed order: one transpose below for all
        log_norm = None if any(n is None for n in log_norms) else torch.cat(log_norms, dim=-1)
    else:
        out, log_norm = _grouped(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, norms=norms is not None)
    if log_norm is not None and norms is not None:
        norms(module, log_norm)
    return out.transpose(1, 2).contiguous(), None


def _grouped(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
             is_causal: bool | None = None, norms: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> output [batch, heads, q, head_dim] (SDPA's layout), and (`norms`) each query's
    log-normaliser [batch, heads, q] float32 where the fused kernel gives it, else None."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:  # no mask over several queries: a plain causal prefill
        is_causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    fused = query.device.type == "cpu" and (attention_mask is None or attention_mask.is_floating_point())
    if norms and not dropout and fused:
        # the kernel scaled_dot_product_attention runs here, called directly for its logsumexp
        # (GQA included; the output is the same, bit for bit: tests/positronic/models/test_attention.py)
        out, log_norm = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attention_mask, scale=scaling)
        return out, log_norm.float()
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1])
    return out, None


def grouped_logits(query: torch.Tensor, keys_t: torch.Tensor, log_norm: torch.Tensor | None = None) -> torch.Tensor:
    """Each query head against its kv head's keys, as grouped-query attention pairs them:
    query [layers, heads, head_dim] (scaled), keys_t [layers, kv_heads, head_dim, rows] (keys
    transposed, any float dtype) -> float32 [layers, kv_heads, heads // kv_heads, rows], where
    the keys are; minus `log_norm` [layers, heads] if given (the log of a row's would-be
    attention share). The brain's attention row, recall's index and the recent-use rank all
    score keys this one way."""
    layers, kv_heads, head_dim, _ = keys_t.shape
    grouped = query.to(keys_t.device, torch.float32).reshape(layers, kv_heads, -1, head_dim)
    logits = grouped @ keys_t.float()  # .float(): no copy of float32 keys
    if log_norm is not None:
        logits -= log_norm.to(logits.device, torch.float32).reshape(layers, kv_heads, -1, 1)
    return logits


def tapped_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' own "sdpa" attention function, with the tap."""
    active = _see(module, query, key, value, kwargs.get("scaling"))
    if isinstance(key, Decode):
        scaling = kwargs.get("scaling") or module.scaling
        wants = active is not None and active[2] is not None
        out, log_norm = decode_attention(query, key, scaling, norms=wants)
        if wants:
            active[2](module, log_norm)
        return out.transpose(1, 2).contiguous(), None
    if isinstance(key, Ragged):
        return _each(ALL_ATTENTION_FUNCTIONS["sdpa"], module, query, key, **kwargs)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, grouped_sdpa)
AttentionInterface.register(ATTENTION_CUDA, tapped_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_CUDA, sdpa_mask)


def for_device(device: torch.device) -> str:
    """The attention implementation a model on `device` runs."""
    return ATTENTION if device.type == "cpu" else ATTENTION_CUDA
