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

import math
from collections.abc import Mapping

import torch

SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}  # pure rotations, attention_scaling 1.0
FAMILIES = {  # model_type -> what it is (proven by tests/positronic/models/test_families.py)
    "llama": "Llama 2 / 3.x, SmolLM2, TinyLlama",
    "mistral": "Mistral (full attention, or a sliding window kept wider than every position)",
    "qwen2": "Qwen2 / Qwen2.5 (q/k/v biases)",
    "qwen3": "Qwen3 (q/k RMSNorm before RoPE)",
    "phi3": "Phi-3 (fused qkv; its 4k models' sliding window kept wider than every position)",
}
MAX_LAYERS = 1024  # the deepest published decoders have ~130 layers; a header stating more is refused unbuilt
_INT_RANGES = {  # config field -> (lowest, highest): far beyond every published model, below what cannot be built
    "num_hidden_layers": (1, MAX_LAYERS),
    "vocab_size": (1, 2**24),
    "hidden_size": (1, 2**17),
    "intermediate_size": (1, 2**20),
    "num_attention_heads": (1, 2**12),
    "num_key_value_heads": (1, 2**12),
    "head_dim": (2, 2**12),
    "max_position_embeddings": (1, 2**30),
}
_OPTIONAL = {"num_key_value_heads", "head_dim"}  # None: as many as the heads; hidden_size / heads
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
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


def check_config(config, fields: Mapping[str, str] | None = None) -> None:
    """Raise ModelError, naming the feature, unless `config` is a decoder of a proven family
    whose layers all attend to the whole cache with pure-rotation RoPE, with every size, id and
    constant in its range (check_ranges; `fields` as there)."""
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
    check_ranges(config, fields)


def check_ranges(config, fields: Mapping[str, str] | None = None) -> None:
    """Raise ModelError, naming the field, unless every size, token id and constant of `config`
    is one a model can be built from: sizes are integers within _INT_RANGES, heads divide
    evenly, a head is an even number of channels (RoPE turns them in pairs), token ids are
    within the vocabulary, RoPE's base and the norm's epsilon are finite. A value read from a
    file that lies would otherwise surface as an IndexError, a ZeroDivisionError or an
    allocation of terabytes deep inside transformers. `fields`: config field -> where the
    value came from (a GGUF key), named beside it."""
    def name(field: str) -> str:
        return f"{field} ({fields[field]})" if fields and field in fields else field

    values = {}
    for field, (low, high) in _INT_RANGES.items():
        value = getattr(config, field, None)
        if value is None and field in _OPTIONAL:
            continue
        if type(value) is not int or not low <= value <= high:
            raise ModelError(f"{name(field)} = {value!r} is out of range: an integer from {low} to {high} is required")
        values[field] = value
    heads = values["num_attention_heads"]
    kv_heads = values.get("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelError(f"{name('num_attention_heads')} = {heads} is not a multiple of "
                         f"{name('num_key_value_heads')} = {kv_heads}: each key head serves a whole group")
    head_dim = values.get("head_dim")
    if head_dim is None:
        if values["hidden_size"] % heads:
            raise ModelError(f"{name('hidden_size')} = {values['hidden_size']} is not divisible by "
                             f"{name('num_attention_heads')} = {heads}, and no head_dim is given")
        head_dim = values["hidden_size"] // heads
    if head_dim % 2:
        raise ModelError(f"{name('head_dim')} = {head_dim} is odd: RoPE rotates a head's channels in pairs")
    vocab = values["vocab_size"]
    for field in _TOKEN_IDS:
        value = getattr(config, field, None)
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and (type(token) is not int or not 0 <= token < vocab):
                raise ModelError(f"{name(field)} = {token!r} is not a token id: the vocabulary has {vocab} "
                                 f"(0 to {vocab - 1})")
    rope = _rope(config)
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None)) if isinstance(rope, dict) else None
    if theta is not None and not _finite(theta, above=0):
        raise ModelError(f"{name('rope_theta')} = {theta!r} is out of range: RoPE's base must be a finite number "
                         "above 0")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if isinstance(rope, dict) and key in rope and not _finite(rope[key], above=0):
            raise ModelError(f"RoPE {key} = {rope[key]!r} is out of range: a finite number above 0 is required")
    eps = getattr(config, "rms_norm_eps", None)
    if eps is not None and not _finite(eps, above=None):
        raise ModelError(f"{name('rms_norm_eps')} = {eps!r} is out of range: a finite number from 0 is required")


def _finite(value, above: float | None) -> bool:
    """Whether `value` is a real number, finite, and above `above` (None: at least 0)."""
    if type(value) not in (int, float) or not math.isfinite(value):
        return False
    return value > above if above is not None else value >= 0


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


def model_tensors(config) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold for `config`'s model: name -> shape, from the model
    built on the meta device (no memory is taken; check_ranges bounds the build's time). A tied
    tensor (the output layer sharing the embeddings) is listed once, under its first name, as a
    checkpoint stores it."""
    import transformers

    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:  # a config transformers refuses to build from: one line, not a traceback
        from ..util import error_line
        raise ModelError(f"cannot build a model from the config: {error_line(e)}") from None
    seen, tensors = set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = tuple(tensor.shape)
    return tensors


def stored_shapes(files: list) -> dict[str, tuple[int, ...]]:
    """Every tensor the safetensors `files` hold: name -> shape, read from their headers only
    (nothing is loaded). Errors are the files' own (OSError, safetensors' errors)."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), "pt") as weights:
            shapes.update({key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()})
    return shapes


def check_tensors(have: Mapping[str, tuple[int, ...]], need: Mapping[str, tuple[int, ...]], where: str,
                  config_source: str = "the config") -> None:
    """Raise ModelError unless `have` (a checkpoint's tensors: name -> shape) is exactly `need`:
    a missing tensor would be initialised at random, one left over means the config describes
    another model than the file holds (fewer layers, say), one of another shape would not load.
    The message names the tensors, `where` the checkpoint."""
    missing = [name for name in need if name not in have]
    if missing:
        raise ModelError(f"{where} lacks {tensor_list(missing)}, which the model needs: its weights would be made up")
    for name, shape in need.items():
        if tuple(have[name]) != tuple(shape):
            raise ModelError(f"{where}: tensor {printable(name)} has shape {list(have[name])}, {config_source} makes it "
                             f"{list(shape)}")
    extra = [name for name in have if name not in need]
    if extra:
        raise ModelError(f"{where} holds {tensor_list(extra)}, which the model does not use: {config_source} describes "
                         "another model than the file holds")


def tensor_list(names: list[str], shown: int = 4) -> str:
    """'tensor a' or 'tensors a, b, c, d and 5 more', each name printable."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ("tensor " if len(names) == 1 else "tensors ") + ", ".join(map(printable, names[:shown])) + more


def printable(name: str) -> str:
    """`name` as it is, or quoted with escapes where it holds a newline or another unprintable
    character: a name read from a file must not break the one-line message it is put in."""
    return name if name.isprintable() else repr(name)


def check_loading_info(info: Mapping, where: str) -> None:
    """Raise ModelError unless transformers' loading report (from_pretrained's
    output_loading_info) says every weight came from the checkpoint as it is: transformers
    initialises a missing or mis-shaped tensor at random and says so only in a log line."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelError(f"{where} lacks {tensor_list(missing)}, which the model needs: its weights would be made up")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        name, have, need = mismatched[0]
        raise ModelError(f"{where}: tensor {printable(name)} has shape {list(have)}, the config makes it {list(need)}")
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        raise ModelError(f"{where} holds {tensor_list(unexpected)}, which the model does not use: the config describes "
                         "another model than the checkpoint holds")
    errors = info.get("error_msgs") or []
    if errors:
        raise ModelError(f"{where}: {' '.join(str(errors[0]).split())}")
