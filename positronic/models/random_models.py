"""Random-weight Llamas with a byte tokenizer: "random:tiny" for unit tests, "random:tinyllama"
for TinyLlama's shape without its 2 GB download. Weights are deterministic and drawn without
touching torch's global RNG."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from .checks import ModelError

RANDOM_SHAPES = {
    "tinyllama": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=2048, rms_norm_eps=1e-5),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=512, rms_norm_eps=1e-5),
}


def random_model(shape: str, dev: torch.device, dt: torch.dtype):
    if shape not in RANDOM_SHAPES:
        raise ModelError(f"unknown random shape {shape!r}: expected one of "
                         + ", ".join(f"random:{s}" for s in RANDOM_SHAPES))
    config = LlamaConfig(**RANDOM_SHAPES[shape], rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=None)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device("meta"):  # no init work here; filled in below
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=dev)
    model._init_weights(model.model.rotary_emb)  # recompute inv_freq buffers (float32)
    _fill_random(model, dev, std=config.initializer_range)
    return model, byte_tokenizer(config.vocab_size)


def _fill_random(model, dev: torch.device, std: float) -> None:
    """Deterministic weights: norms 1, matrices uniform with the given std, parameter i drawn
    from its own generator seeded with i (threads on CPU: a 1.1B model fills in ~5 s, not ~20 s)."""
    bound = std * 3 ** 0.5

    def fill(item):
        i, p = item
        if p.dim() == 1:
            p.data.fill_(1.0)
        else:
            p.data.uniform_(-bound, bound, generator=torch.Generator(dev).manual_seed(i))

    with torch.no_grad():
        if dev.type == "cpu":
            with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
                list(pool.map(fill, enumerate(model.parameters())))
        else:
            list(map(fill, enumerate(model.parameters())))


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


