"""Random-weight models with a byte tokenizer: "random:tiny" for unit tests, "random:tinyllama"
for TinyLlama's shape without its 2 GB download, and one tiny model per supported family on
that family's real transformers class ("random:llama3", "random:qwen2", "random:qwen3",
"random:mistral", "random:phi3"): what splicing depends on (RoPE type, theta and scaling, head_dim
against hidden / heads, the GQA ratio, biases, q/k norms, tied embeddings, a sliding window) is
the published config's, the sizes are scaled down (tests/positronic/models/test_families.py
holds each to its real model's published values). Weights are deterministic and drawn without
touching torch's global RNG."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch
import transformers
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                          Qwen3Config)

from .checks import ModelError

RANDOM_SHAPES = {
    "tinyllama": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=2048, rms_norm_eps=1e-5),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=512, rms_norm_eps=1e-5),
}


_SMALL = dict(num_hidden_layers=2, intermediate_size=128, vocab_size=512, max_position_embeddings=512)
# name -> (config class, the real model it is scaled from, its settings). Heads : kv heads, head_dim
# (explicit where the real one differs from hidden / heads), RoPE, biases and the sliding window
# follow the real config; the window keeps its ratio to max_position_embeddings (2047 / 4096).
FAMILY_SHAPES = {
    "llama3": (LlamaConfig, "meta-llama/Llama-3.2-1B", dict(
        _SMALL, max_position_embeddings=131072, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
        head_dim=8, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False, mlp_bias=False)),
    "qwen2": (Qwen2Config, "Qwen/Qwen2.5-0.5B-Instruct", dict(
        _SMALL, hidden_size=112, num_attention_heads=14, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=512, max_window_layers=2)),
    "qwen3": (Qwen3Config, "Qwen/Qwen3-0.6B", dict(
        _SMALL, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, use_sliding_window=False, sliding_window=None,
        max_window_layers=2)),
    "mistral": (MistralConfig, "mistralai/Mistral-7B-Instruct-v0.3", dict(
        _SMALL, hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=None)),
    "phi3": (Phi3Config, "microsoft/Phi-3-medium-4k-instruct", dict(
        _SMALL, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=255, original_max_position_embeddings=512)),
}


def random_names() -> list[str]:
    """Every random model name, "random:..."."""
    return [f"random:{name}" for name in [*RANDOM_SHAPES, *FAMILY_SHAPES]]


def random_config(shape: str):
    """The config of random model `shape` (a RANDOM_SHAPES Llama or a FAMILY_SHAPES family)."""
    if shape in RANDOM_SHAPES:
        return LlamaConfig(**RANDOM_SHAPES[shape], rope_theta=10000.0, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2, pad_token_id=None)
    if shape in FAMILY_SHAPES:
        config_class, _, settings = FAMILY_SHAPES[shape]
        return config_class(**settings, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    raise ModelError(f"unknown random shape {shape!r}: expected one of {', '.join(random_names())}")


def random_model(shape: str, dev: torch.device, dt: torch.dtype):
    config = random_config(shape)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device("meta"):  # no init work here; filled in below
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=dev)
    model.tie_weights()  # to_empty gave the tied output layer storage of its own
    model._init_weights(model.model.rotary_emb)  # recompute inv_freq buffers (float32)
    _fill_random(model, dev, std=config.initializer_range)
    return model, byte_tokenizer(config.vocab_size)


def _fill_random(model, dev: torch.device, std: float) -> None:
    """Deterministic weights: norms 1, matrices and biases uniform with the given std, parameter i
    drawn from its own generator seeded with i (threads on CPU: a 1.1B model fills in ~5 s, not ~20 s)."""
    bound = std * 3 ** 0.5
    named = list(model.named_parameters())

    def fill(item):
        i, (name, p) = item
        if p.dim() == 1 and not name.endswith("bias"):
            p.data.fill_(1.0)
        else:
            p.data.uniform_(-bound, bound, generator=torch.Generator(dev).manual_seed(i))

    with torch.no_grad():
        if dev.type == "cpu":
            with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
                list(pool.map(fill, enumerate(named)))
        else:
            list(map(fill, enumerate(named)))


def byte_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level tokenizer covering every id in [0, vocab_size): 0..2 are <unk>, <s>, </s>,
    3..258 the 256 bytes, the rest placeholders "<rN>". Adds no special tokens when encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({byte_chars[b]: 3 + b for b in range(256)})
    vocab.update({f"<r{i}>": i for i in range(259, vocab_size)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")


