"""Exact re-rotation of stored keys from one RoPE position to another.

Llama keys are stored already rotated: k_p = R(p) k, where R(p) rotates each frequency
pair (i, i + d/2) by the angle p * inv_freq[i]. Rotations compose, so moving a key from
position p to q is R(q - p) k_p — no model forward needed. The arithmetic runs in float32
and is applied only when positions must move (no room, or near the model's limit), so the
rounding a float16 key picks up is bounded by how often it is moved, not by how many
edits it lives through.
"""

from __future__ import annotations

import torch


def angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The angles transformers rotates a key at `positions` by: float32 products, [rows, head_dim / 2]."""
    return positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]


def rotation(
    inv_freq: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin that move keys from `old_positions` to `new_positions` ([rows] integer).

    The step is the difference of the two float32 angles transformers itself would use,
    taken in float64, so a moved key matches one computed fresh at its new position even
    where float32 angles are coarse (about 5e-4 rad near position 8192).
    Returns cos, sin: [rows, head_dim] float32, laid out like transformers' rotary embedding.
    """
    step = angles(inv_freq, new_positions).double() - angles(inv_freq, old_positions).double()
    step = torch.cat([step, step], dim=-1)
    return step.cos().to(torch.float32), step.sin().to(torch.float32)


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate keys [..., rows, head_dim] by cos/sin [rows, head_dim]; computed in float32."""
    k = keys.to(torch.float32)
    half = k.shape[-1] // 2
    rotated_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    cos, sin = cos.to(k.device), sin.to(k.device)
    return (k * cos + rotated_half * sin).to(keys.dtype)


def inv_freq_for_config(config) -> torch.Tensor:
    """The inverse frequencies a Llama config's rotary embedding uses, float32 [head_dim / 2]
    on the CPU. Refuses RoPE that scales as well as rotates (keys could not be un-rotated)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    if float(rotary.attention_scaling) != 1.0:
        raise ValueError(f"RoPE attention scaling {rotary.attention_scaling} is not a pure rotation: "
                         "keys cannot be un-rotated exactly")
    return rotary.inv_freq.detach().to("cpu", torch.float32)
