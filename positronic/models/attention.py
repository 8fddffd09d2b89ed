"""The attention function the loaded models run: PyTorch's scaled_dot_product_attention with
grouped-query attention kept even when a mask is given.

transformers' own "sdpa" path passes `enable_gqa` to SDPA only when there is no mask (its
CUDA kernels fall back to the slow path with both); with a mask it first copies every key and
value head `heads / kv_heads` times (`repeat_kv`). On a CPU, PyTorch's kernels take both, and
the copy is what a masked forward pays: for SmolLM2 (9 query heads on 3 kv heads) a masked
tick over 1,024 rows costs ~1 ms more, the whole price of the ring store's free-slot mask and
of every inserted-token forward. So models on a CPU run `ATTENTION` (registered with
transformers' AttentionInterface, with transformers' SDPA mask builder); on a GPU they keep
"sdpa". Same arithmetic either way (tests compare logits with plain transformers).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION = "positronic_sdpa"


def grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [batch, heads, q, head_dim], key / value [batch, kv_heads, k, head_dim], mask
    broadcastable to [batch, heads, q, k] (additive or boolean) or None -> output
    [batch, q, heads, head_dim] (transformers' attention-function contract; no weights)."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:  # no mask over several queries: a plain causal prefill
        is_causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, grouped_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def for_device(device: torch.device) -> str:
    """The attention implementation a model on `device` runs."""
    return ATTENTION if device.type == "cpu" else "sdpa"
