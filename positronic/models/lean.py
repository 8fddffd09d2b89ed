"""A Llama model's forward without the library's per-call scaffolding.

The state's forwards bring their own positions and mask: a 4D additive mask, or none for one
newest token. transformers' Llama forward wraps each in decorators (deprecated keywords,
output capture, config defaults, tuple returns), keyword plumbing through every layer, a mask
builder that hands such a mask back as it is (or None for one token), and output dataclasses:
on the embedded model at 2 CPU threads that was ~4 ms of a 30 ms int8 decode tick
(bench/results/weights.md).

`LeanLlama` runs the same modules in the same order with the same arithmetic: the
embedding, the rotary module's cos and sin, then per layer its RMSNorm, q/k/v projections,
the library's own `apply_rotary_pos_emb`, the cache's `update`, the attention function the
model is set to (the tap included), the output projection, the residuals, the second norm and
the MLP; then the final norm and the logits. So its logits and every row it writes are the
library forward's bits, for every weight format (tests/positronic/models/test_lean.py).

It runs only where that holds by construction: every module it steps through is exactly one
of transformers' Llama classes (a subclass or another family goes through `model(...)`), none
of the modules it does not call (the model, its decoder layers and attention modules) has a
hook or a forward of its own, and the mask is a prepared 4D one or absent for one token (where the library builds
none); `lean_forward` says None otherwise and the caller runs `model(...)`.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama

from .compat import with_cache
from .tiles import RowTiles

# what a Llama decoder is made of, class for class: a subclass may compute something else
_LAYER = {"": llama.LlamaDecoderLayer, "self_attn": llama.LlamaAttention, "mlp": llama.LlamaMLP,
          "input_layernorm": llama.LlamaRMSNorm, "post_attention_layernorm": llama.LlamaRMSNorm}
_LEAN: "weakref.WeakKeyDictionary[nn.Module, LeanLlama | None]" = weakref.WeakKeyDictionary()


class LeanLlama:
    """`lean(input_ids [batch, tokens], position_ids [batch, tokens], cache, mask)` -> logits
    [batch, tokens, vocab] (`last`: [batch, 1, vocab]): the model's forward, the cache written as
    the model writes it (module docstring). `mask`: additive [batch, 1, tokens, rows], or None
    for one token that sees every row."""

    def __init__(self, model: nn.Module):
        self.model, self.core = model, model.model
        self.layers = list(self.core.layers[: model.config.num_hidden_layers])
        # the containers whose forward is not called: a hook on one of them would be skipped
        self.skipped = [model, self.core, *self.layers, *(layer.self_attn for layer in self.layers)]

    @staticmethod
    def fits(model: nn.Module, tiled: bool = False) -> bool:
        """Whether `model` is transformers' Llama, class for class (module docstring); `tiled`:
        its norms may be the same classes computing in row tiles (models/tiles.py)."""
        def kind(module: nn.Module) -> type:
            cls = type(module)
            return cls.__bases__[1] if tiled and issubclass(cls, RowTiles) else cls

        core = getattr(model, "model", None)
        if type(model) is not llama.LlamaForCausalLM or type(core) is not llama.LlamaModel:
            return False
        if kind(core.norm) is not llama.LlamaRMSNorm or type(core.rotary_emb) is not llama.LlamaRotaryEmbedding:
            return False
        return all(kind(layer.get_submodule(name)) is cls for layer in core.layers for name, cls in _LAYER.items())

    def ready(self) -> bool:
        """No hook on a module whose forward is skipped, nor a forward of its own put on one (a
        test's injected fault), and the model's attention one that takes the library's arguments
        (checked every call: hooks come and go)."""
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        if self.model.config._attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in self.skipped)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, mask: torch.Tensor | None = None,
                 *, last: bool = False) -> torch.Tensor:
        if mask is None and input_ids.numel() != 1 or mask is not None and mask.dim() != 4:
            raise ValueError("a lean forward takes a prepared 4D mask, or one token without one")
        attend = ALL_ATTENTION_FUNCTIONS[self.model.config._attn_implementation]
        hidden = self.core.embed_tokens(input_ids)  # [batch, tokens, hidden]
        cos, sin = self.core.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            attention = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            shape = (*hidden.shape[:-1], -1, attention.head_dim)
            query = attention.q_proj(hidden).view(shape).transpose(1, 2)  # [batch, heads, tokens, head_dim]
            key = attention.k_proj(hidden).view(shape).transpose(1, 2)  # [batch, kv_heads, tokens, head_dim]
            value = attention.v_proj(hidden).view(shape).transpose(1, 2)
            query, key = llama.apply_rotary_pos_emb(query, key, cos, sin)
            key, value = cache.update(key, value, attention.layer_idx)  # every row the layer attends over
            out, _ = attend(attention, query, key, value, mask, dropout=0.0, scaling=attention.scaling)
            hidden = residual + attention.o_proj(out.reshape(*out.shape[:-2], -1).contiguous())
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.core.norm(hidden)
        return self.model.lm_head(hidden[:, -1:] if last else hidden)


def lean_forward(model: nn.Module) -> LeanLlama | None:
    """The model's `LeanLlama` where it fits and is ready now, else None (the library's forward)."""
    if model not in _LEAN:
        _LEAN[model] = LeanLlama(model) if LeanLlama.fits(model) else None
    lean = _LEAN[model]
    return lean if lean is not None and lean.ready() else None


def logits_of(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cache,
              mask: torch.Tensor | None = None, *, last: bool = False) -> torch.Tensor:
    """The forward every state makes: `model`'s logits [batch, tokens or 1 (`last`), vocab] for
    `input_ids` at `position_ids` over `cache` under `mask` (4D additive, or None for one token
    that sees every row), through `LeanLlama` where it runs, else the library's forward."""
    lean = lean_forward(model) if mask is not None or input_ids.numel() == 1 else None
    if lean is not None:
        return lean(input_ids, position_ids, cache, mask, last=last)
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **with_cache(cache),
                 use_cache=True, logits_to_keep=1 if last else 0).logits
