"""What makes a model one the splice code handles exactly, and the errors loading raises.

Cache splicing re-rotates keys by position differences and masks by position, so it needs a
Llama whose RoPE is a pure rotation by position * inv_freq (attention scaling 1.0) and whose
layers all attend to the whole cache; and a tokenizer that adds nothing when asked not to
(the brain adds BOS itself and counts every token it writes).
"""

from __future__ import annotations

from transformers import LlamaForCausalLM

SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}  # pure rotations, attention_scaling 1.0


class ModelError(Exception):
    """A model cannot be loaded or is not one the splice code handles exactly (one-line message)."""


class ModelNotAvailable(ModelError):
    """The model's files are neither local nor downloadable from here."""



def check_config(config) -> None:
    """Raise ModelError unless the config is a Llama causal LM whose RoPE is a pure rotation
    by position * inv_freq and whose attention is full (what cache splicing handles exactly)."""
    model_type = getattr(config, "model_type", None)
    if model_type != "llama":
        raise ModelError(f"model type {model_type!r} is not supported: only Llama-family "
                         "(model_type 'llama', LlamaForCausalLM) models can be spliced exactly")
    archs = getattr(config, "architectures", None) or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in archs:
        raise ModelError(f"architecture {archs} is not supported: only LlamaForCausalLM")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(f"RoPE type {rope_type!r} is not supported: positions must be pure "
                         f"rotations ({', '.join(sorted(SUPPORTED_ROPE_TYPES))})")
    layer_types = set(getattr(config, "layer_types", None) or [])
    if getattr(config, "sliding_window", None) or layer_types - {"full_attention"}:
        raise ModelError("sliding-window attention is not supported: every layer must attend "
                         "to the whole cache")



def check_model(name: str, model, tokenizer) -> None:
    """Raise ModelError unless the loaded `model` and `tokenizer` meet what check_config asks
    of the config, and the tokenizer adds no special tokens on its own."""
    check_config(model.config)
    if not isinstance(model, LlamaForCausalLM):
        raise ModelError(f"{type(model).__name__} is not supported: only LlamaForCausalLM")
    rotary = model.model.rotary_emb
    if float(rotary.attention_scaling) != 1.0:
        raise ModelError(f"RoPE attention scaling {rotary.attention_scaling} is not supported (must be 1.0)")
    probe = tokenizer.encode("Hello", add_special_tokens=False)
    specials = set(tokenizer.all_special_ids)
    if tokenizer.encode("", add_special_tokens=False) or specials & set(probe):
        raise ModelError(f"tokenizer of {name!r} inserts special tokens even with add_special_tokens=False")
