"""One new token through a Llama model, without the library's per-call scaffolding.

A decode tick feeds one token. transformers' Llama forward wraps it in decorators (deprecated
keywords, output capture, config defaults, tuple returns), keyword plumbing through every
layer, a causal-mask builder that answers None for one newest token, and output dataclasses:
on the embedded model at 2 CPU threads that was ~4 ms of a 30 ms int8 tick
(bench/results/weights.md, "Decode without the scaffolding").

`LlamaDecode` runs the same modules in the same order with the same arithmetic: the
embedding, the rotary module's cos and sin, then per layer its RMSNorm, q/k/v projections,
the library's own `apply_rotary_pos_emb`, the cache's `update`, the attention function the
model is set to (the tap included), the output projection, the residuals, the second norm and
the MLP; then the final norm and the logits. So its logits and every row it writes are the
library forward's bits, for every weight format (tests/positronic/models/test_decode.py).

It runs only where that holds by construction: every module it steps through is exactly one
of transformers' Llama classes (a subclass or another family goes through `model(...)`), none
of the modules it does not call (the model, its decoder layers and attention modules) has a
hook, and the forward is one token with no mask (a decode tick; prompts and spliced rows with
their masks take the library's forward).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama

# what a Llama decoder is made of, class for class: a subclass may compute something else
_LAYER = {"": llama.LlamaDecoderLayer, "self_attn": llama.LlamaAttention, "mlp": llama.LlamaMLP,
          "input_layernorm": llama.LlamaRMSNorm, "post_attention_layernorm": llama.LlamaRMSNorm}
_DECODERS: "weakref.WeakKeyDictionary[nn.Module, LlamaDecode | None]" = weakref.WeakKeyDictionary()


class LlamaDecode:
    """`decode(input_ids [1, 1], position_ids [1, 1], cache)` -> logits [1, 1, vocab]: the
    model's forward for one token, the cache written as the model writes it (module docstring)."""

    def __init__(self, model: nn.Module):
        self.model, self.core = model, model.model
        self.layers = list(self.core.layers[: model.config.num_hidden_layers])
        # the containers whose forward is not called: a hook on one of them would be skipped
        self.skipped = [model, self.core, *self.layers, *(layer.self_attn for layer in self.layers)]

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether `model` is transformers' Llama, class for class (module docstring)."""
        core = getattr(model, "model", None)
        if type(model) is not llama.LlamaForCausalLM or type(core) is not llama.LlamaModel:
            return False
        if type(core.norm) is not llama.LlamaRMSNorm or type(core.rotary_emb) is not llama.LlamaRotaryEmbedding:
            return False
        return all(type(layer.get_submodule(name)) is kind for layer in core.layers for name, kind in _LAYER.items())

    def ready(self) -> bool:
        """No hook on a module whose forward is skipped, and the model's attention one that takes
        the library's arguments (checked every call: hooks come and go)."""
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        if self.model.config._attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self.skipped)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        attend = ALL_ATTENTION_FUNCTIONS[self.model.config._attn_implementation]
        hidden = self.core.embed_tokens(input_ids)  # [1, 1, hidden]
        cos, sin = self.core.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            attention = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            shape = (*hidden.shape[:-1], -1, attention.head_dim)
            query = attention.q_proj(hidden).view(shape).transpose(1, 2)  # [1, heads, 1, head_dim]
            key = attention.k_proj(hidden).view(shape).transpose(1, 2)  # [1, kv_heads, 1, head_dim]
            value = attention.v_proj(hidden).view(shape).transpose(1, 2)
            query, key = llama.apply_rotary_pos_emb(query, key, cos, sin)
            key, value = cache.update(key, value, attention.layer_idx)  # every row: [1, kv_heads, rows, head_dim]
            out, _ = attend(attention, query, key, value, None, dropout=0.0, scaling=attention.scaling)
            hidden = residual + attention.o_proj(out.reshape(*out.shape[:-2], -1).contiguous())
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(self.core.norm(hidden))


def lean_decoder(model: nn.Module) -> LlamaDecode | None:
    """The model's `LlamaDecode` where it fits and is ready now, else None (the library's forward)."""
    if model not in _DECODERS:
        _DECODERS[model] = LlamaDecode(model) if LlamaDecode.fits(model) else None
    decoder = _DECODERS[model]
    return decoder if decoder is not None and decoder.ready() else None
