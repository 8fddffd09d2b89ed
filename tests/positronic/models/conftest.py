"""What the model tests share: a refusal's one-line message, RoPE's textbook frequencies, an
eager-attention forward to compare SDPA against, and a random model written as a GGUF file."""

from pathlib import Path

import pytest
import torch

from positronic.models import load_model


def _one_line_error(exc_type, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        load_model(*args, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message
    return message


@pytest.fixture(scope="session")
def one_line_error():
    """one_line_error(ExcType, *load_model_args): the message, asserted to be one line."""
    return _one_line_error


@pytest.fixture(scope="session")
def expected_inv_freq():
    """expected_inv_freq(theta, head_dim): RoPE's frequencies written from the paper's formula."""
    return lambda theta, head_dim: 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)


def _eager_forward(lm, ids: list[int]):
    previous = lm.model.config._attn_implementation
    lm.model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            return lm.model(torch.tensor([ids]), output_attentions=True)
    finally:
        lm.model.config._attn_implementation = previous


@pytest.fixture(scope="session")
def eager_forward():
    """eager_forward(lm, ids): a plain forward with eager attention and its attention weights
    (the model is switched back to SDPA afterwards)."""
    return _eager_forward


def _write_gguf(lm, path: Path) -> Path:
    """Write `lm` (a random family model, float32) to `path` as an F32 GGUF of its architecture:
    what llama.cpp's convert_hf_to_gguf.py writes for it, unquantized. Its metadata keys
    (`<arch>.context_length`, `.attention.key_length`, ...), its tensor names (gguf's own name
    map: token_embd, blk.N.attn_q / attn_q_norm / ..., output_norm; no output.weight when the
    embeddings are tied), q/k unpermuted (llama.cpp permutes, and transformers un-permutes,
    llama's only: so qwen2 / qwen3 here), and a "gpt2" (byte-level BPE) tokenizer. The random
    models' tokenizer is byte-level BPE with no merges; GGUF cannot hold an empty merges array
    (gguf's writer refuses one), so the file omits the key and gives scores instead, from which
    transformers (>= 5.18) derives the merges: none, as no token of this vocabulary splits into
    two others. The same tokenizer, stated another way."""
    import gguf

    config, tokenizer = lm.model.config, lm.tokenizer
    arch = config.model_type
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"random {arch}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(lm.head_dim)
    writer.add_value_length(lm.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)

    tokens = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)
    assert len(tokens) == config.vocab_size and tokenizer.get_vocab()[tokens[-1]] == config.vocab_size - 1
    specials = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)  # byte tokens already in the byte-level spelling, <..> tokens plain ASCII
    writer.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_scores([0.0] * len(tokens))  # no merges key: see the module's docstring
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_add_bos_token(False)

    for name, tensor in lm.model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes output.weight only when it is not the embedding matrix
        module, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(module)
        assert gguf_name is not None, f"no GGUF name for {name}"
        writer.add_tensor(f"{gguf_name}.{suffix}", tensor.detach().to(torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def write_gguf():
    """write_gguf(lm, path) -> path: `lm` (random:qwen2 / random:qwen3, float32) as an F32 GGUF file."""
    return _write_gguf
