"""Key centres for the int4h format: each layer's mean key before RoPE, per kv head.

A Llama layer's keys share a large common part: a few channels hold a big value of the same
sign for almost every token (before RoPE; after it, that part turns with the position). int4h
subtracts it before quantizing (kv_formats.Int4H, int4h.Int4HLayer), so the 16 levels of a
group are spent on what differs between tokens. The centre is a property of the model, not of
the text: one prefill of the package's own text (texts/alice_ch1-2.txt, public domain) gives
it, once per loaded model and device.

Measured on SmolLM2-135M (bench/results/history/kv_formats.md, "int4h"): with centres from another text,
int4h is within 3% of the float cache's perplexity; without them (zeros) about 5%.
"""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache

from . import rope
from ..models.compat import with_cache
from ..texts import DEFAULT_TEXT

CALIBRATION_TOKENS = 512
_CENTRES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> centres


@torch.no_grad()
def compute_key_centres(lm, token_ids: list[int]) -> torch.Tensor:
    """The mean pre-RoPE key of every layer and kv head over `token_ids` (one prefill at
    positions 0..n-1): float32 [layers, kv_heads, head_dim] on the model's device."""
    cache = DynamicCache()  # no config: a sliding-window model's would keep only its window
    lm.model(input_ids=torch.tensor([token_ids], device=lm.device), **with_cache(cache), use_cache=True)
    positions = torch.arange(len(token_ids))
    cos, sin = rope.rotation(lm.inv_freq, positions, torch.zeros_like(positions))
    return torch.stack([rope.rotate(layer.keys.float(), cos, sin)[0].mean(dim=1) for layer in cache.layers])


def key_centres(lm) -> torch.Tensor:
    """`compute_key_centres` over the first CALIBRATION_TOKENS tokens of the package's text
    (BOS first), computed once per model object."""
    if lm.model not in _CENTRES:
        ids = ([lm.bos_id] if lm.bos_id is not None else []) + lm.encode(DEFAULT_TEXT.read_text(encoding="utf-8"))
        ids = ids[: min(CALIBRATION_TOKENS, lm.max_positions)]
        _CENTRES[lm.model] = compute_key_centres(lm, ids)
    return _CENTRES[lm.model]
