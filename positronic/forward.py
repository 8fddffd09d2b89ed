"""Every model forward the brain makes goes through `forward()`.

Two choices make a forward over an edited cache correct:
- explicit `position_ids`: rows carry recorded RoPE positions with gaps, so positions can
  never be inferred from the cache length;
- an explicit physical causal mask when more than one query row is fed: query row r may
  see every cached row plus new rows 0..r. Transformers would otherwise derive a mask from
  the positions (and may read gapped positions as packed sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

PREFILL_CHUNK = 512  # query rows per forward when (re)building; bounds eager attention memory


@dataclass
class ForwardResult:
    """logits: [vocab] for the last fed token. attention: [layers, heads, kv_rows] — the last
    fed token's attention over every row of the cache (None unless asked for)."""

    logits: torch.Tensor
    attention: torch.Tensor | None


def causal_mask(past: int, new: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, new, past + new]: new row r sees rows 0 .. past + r."""
    rows = torch.arange(new, device=device)[:, None] + past
    cols = torch.arange(past + new, device=device)[None, :]
    mask = torch.zeros(new, past + new, dtype=dtype, device=device)
    mask.masked_fill_(cols > rows, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def forward(
    lm, cache: Cache, token_ids: list[int], positions: list[int], *, attention: bool = False
) -> ForwardResult:
    """Feed `token_ids` at RoPE `positions` after the rows already in `cache` (which grows).

    The model appends the new rows' K/V to `cache` itself through `Cache.update`.
    """
    if len(token_ids) != len(positions) or not token_ids:
        raise ValueError("forward needs one position per token, and at least one token")
    device = lm.device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    pos = torch.tensor([positions], dtype=torch.long, device=device)
    past = cache.get_seq_length()
    mask = causal_mask(past, len(token_ids), lm.dtype, device) if len(token_ids) > 1 else None
    out = lm.model(
        input_ids=ids,
        position_ids=pos,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        output_attentions=attention,
        logits_to_keep=1,
    )
    rows = None
    if attention:
        rows = torch.stack([layer[0, :, -1, :] for layer in out.attentions]).float()
    return ForwardResult(logits=out.logits[0, -1].float(), attention=rows)


def prefill(lm, cache: Cache, token_ids: list[int], positions: list[int]) -> ForwardResult:
    """Feed a long span in chunks; the last token alone, so its attention row is cheap."""
    for start in range(0, len(token_ids) - 1, PREFILL_CHUNK):
        stop = min(start + PREFILL_CHUNK, len(token_ids) - 1)
        forward(lm, cache, token_ids[start:stop], positions[start:stop])
    return forward(lm, cache, token_ids[-1:], positions[-1:], attention=True)


@torch.no_grad()
def fresh_layer0_kv(lm, token_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K/V computed from scratch: they depend only on token and position.

    Returns keys, values: [1, kv_heads, rows, head_dim] in the model's dtype — what a fresh
    prefill of `token_ids` at `positions` would store in layer 0.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = lm.model.model
    ids = torch.tensor([token_ids], dtype=torch.long, device=lm.device)
    pos = torch.tensor([positions], dtype=torch.long, device=lm.device)
    hidden = model.embed_tokens(ids)
    layer = model.layers[0]
    normed = layer.input_layernorm(hidden)
    shape = (1, len(token_ids), -1, lm.head_dim)
    keys = layer.self_attn.k_proj(normed).view(shape).transpose(1, 2)
    values = layer.self_attn.v_proj(normed).view(shape).transpose(1, 2)
    cos, sin = model.rotary_emb(hidden, pos)
    _, keys = apply_rotary_pos_emb(keys, keys, cos, sin)
    return keys, values
