"""What makes a model one the splice code handles exactly, and the errors loading raises.

Splicing needs three things of a decoder (docs/models.md has the table per family):
- every layer attends to the whole cache (or to a sliding window wider than every position the
  cache will use: positions are then kept below the window, `position_limit`, so it never hides a row);
- RoPE on every layer that is a pure rotation by position * inv_freq, the same for every key
  whatever the sequence length, with attention scaling 1.0 (keys are re-rotated by position
  differences and masked by position);
- a tokenizer that adds nothing when asked not to (the brain adds BOS itself and counts every
  token it writes).
How a family projects, biases and normalises its queries and keys does not matter: the code
reads them through the attention tap (attention.py), as the model attends with them. Model
types are still listed (`FAMILIES`): each one's exactness is proven by tests on its real
transformers class (tests/positronic/models/test_families.py); a type nobody has proven is
refused even when no feature below rules it out.
"""

from __future__ import annotations

import torch

SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}  # pure rotations, attention_scaling 1.0
FAMILIES = {  # model_type -> what it is (proven by tests/positronic/models/test_families.py)
    "llama": "Llama 2 / 3.x, SmolLM2, TinyLlama",
    "mistral": "Mistral (full attention, or a sliding window kept wider than every position)",
    "qwen2": "Qwen2 / Qwen2.5 (q/k/v biases)",
    "qwen3": "Qwen3 (q/k RMSNorm before RoPE)",
    "phi3": "Phi-3 (fused qkv; its 4k models' sliding window kept wider than every position)",
}
_ROPE_REFUSALS = {
    "dynamic": "rescales its frequencies with the sequence length, so a stored key's rotation would change as "
               "the context grows",
    "longrope": "switches its frequency factors at a sequence length, so a stored key's rotation depends on "
                "how long the context is",
    "yarn": "multiplies queries and keys by an attention factor besides rotating them",
}


class ModelError(Exception):
    """A model cannot be loaded or is not one the splice code handles exactly (one-line message)."""


class ModelNotAvailable(ModelError):
    """The model's files are neither local nor downloadable from here."""


def _rope(config) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def check_config(config) -> None:
    """Raise ModelError, naming the feature, unless `config` is a decoder of a proven family
    whose layers all attend to the whole cache with pure-rotation RoPE."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"model type {model_type!r} is an encoder-decoder: only decoder-only causal LMs are supported")
    rope = _rope(config)
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        raise ModelError(f"model type {model_type!r} has a RoPE per layer type ({', '.join(rope)}): one rotation "
                         "for every layer is required")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in _ROPE_REFUSALS:
        raise ModelError(f"RoPE type {rope_type!r} is not supported: it {_ROPE_REFUSALS[rope_type]}; positions "
                         f"must be pure rotations ({', '.join(sorted(SUPPORTED_ROPE_TYPES))})")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(f"RoPE type {rope_type!r} is not supported: positions must be pure rotations "
                         f"({', '.join(sorted(SUPPORTED_ROPE_TYPES))})")
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ModelError(f"partial rotary embeddings (factor {partial}) are not supported: every channel of a "
                         "key must rotate")
    if getattr(config, "no_rope_layers", None) and not all(getattr(config, "no_rope_layers")):
        raise ModelError(f"model type {model_type!r} has layers without RoPE: every layer must rotate its keys")
    for feature in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, feature, None):
            raise ModelError(f"attention soft-capping ({feature} = {getattr(config, feature)}) is not supported: "
                             "the attention row must be softmax(q·kᵀ · scaling)")
    layer_types = set(getattr(config, "layer_types", None) or [])
    other = layer_types - {"full_attention", "sliding_attention"}
    if other:
        raise ModelError(f"layer types {sorted(other)} are not supported: every layer must attend to the whole "
                         "cache (full attention, or a sliding window)")
    if "sliding_attention" in layer_types and not getattr(config, "sliding_window", None):
        raise ModelError("sliding-window layers without a sliding_window size are not supported")
    window = getattr(config, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or window < 8):
        raise ModelError(f"sliding window {window!r} is not supported: a window must be an int of at least 8 "
                         "positions (positions are then kept below it)")
    if model_type not in FAMILIES:
        raise ModelError(f"model type {model_type!r} is not supported: exact splicing is proven for "
                         f"{', '.join(sorted(FAMILIES))} (docs/models.md)")


def position_limit(config) -> int:
    """How many RoPE positions the cache may use: the model's `max_position_embeddings`, or a
    sliding window if that is smaller. With every position below the window, each query sees
    every live row, so the window never hides one: the model attends exactly as with full
    attention (transformers' sliding mask hides a key when query - key >= window)."""
    limit = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    return min(limit, int(window)) if window else limit


def check_model(name: str, model, tokenizer) -> None:
    """Raise ModelError unless the loaded `model` and `tokenizer` meet what check_config asks
    of the config, every layer's attention runs through the attention tap, and the tokenizer
    adds no special tokens on its own. The model must already run the tapped attention."""
    from . import attention

    check_config(model.config)
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ModelError(f"{type(model).__name__} has no rotary embedding: positions must be RoPE rotations")
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise ModelError(f"RoPE attention scaling {rotary.attention_scaling} is not supported (must be 1.0)")
    _check_attention_is_tapped(model, attention)
    probe = tokenizer.encode("Hello", add_special_tokens=False)
    specials = set(tokenizer.all_special_ids)
    if tokenizer.encode("", add_special_tokens=False) or specials & set(probe):
        raise ModelError(f"tokenizer of {name!r} inserts special tokens even with add_special_tokens=False")


@torch.no_grad()
def _check_attention_is_tapped(model, attention) -> None:
    """One two-token forward: each layer must hand its attention function a query of the
    config's heads and keys of its kv heads (what the attention row and SmartKV read)."""
    config, seen = model.config, {}
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads

    def see(module, query, key, value, scaling):
        seen[module.layer_idx] = (query.shape[1], key.shape[1])

    device = next(model.parameters()).device
    with attention.tap(see):
        model(input_ids=torch.tensor([[0, 0]], device=device), use_cache=False, logits_to_keep=1)
    layers = config.num_hidden_layers
    if sorted(seen) != list(range(layers)):
        raise ModelError(f"{type(model).__name__}: layers {sorted(set(range(layers)) - set(seen))} do not run the "
                         "model's attention function, so their attention cannot be read")
    wrong = {layer: shape for layer, shape in seen.items() if shape != (heads, kv_heads)}
    if wrong:
        raise ModelError(f"{type(model).__name__}: layers {sorted(wrong)} attend with (heads, kv heads) "
                         f"{next(iter(wrong.values()))}, not the config's ({heads}, {kv_heads})")
