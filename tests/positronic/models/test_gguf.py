"""`--model some.gguf` for a non-Llama family: a GGUF written here from a random family model
(random:qwen3, random:qwen2; no download) in llama.cpp's layout, converted once by gguf.py
through transformers' GGUF loader into $POSITRONIC_CACHE, loads as the same model (class,
logits, tokenizer, shape facts) and the brain runs on it.

The file is what llama.cpp's convert_hf_to_gguf.py writes for these architectures, unquantized
(F32): its metadata keys (`<arch>.context_length`, `.attention.key_length`, ...), its tensor
names (gguf's own name map: token_embd, blk.N.attn_q / attn_q_norm / ..., output_norm; no
output.weight when the embeddings are tied), q/k unpermuted (llama.cpp permutes, and
transformers un-permutes, llama's only), and a "gpt2" (byte-level BPE) tokenizer. The random
models' tokenizer is byte-level BPE with no merges; GGUF cannot hold an empty merges array
(gguf's writer refuses one), so the file omits the key and gives scores instead, from which
transformers derives the merges: none, as no token of this vocabulary splits into two others.
The same tokenizer, stated another way.
"""

import json
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from packaging.version import Version

from positronic.brain.loop import Brain, BrainConfig
from positronic.models import load_model

FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# transformers < 5.18 turns a GGUF "gpt2" tokenizer whose merges come out empty into an
# AttributeError (GGUFQwen2Converter: `if not merges` falls back to the absent bpe_ranks);
# 5.18 rewrote the GGUF tokenizer loading (transformers/integrations/gguf/).
pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.18"),
                                reason="transformers < 5.18 cannot load a GGUF tokenizer with no merges")


def write_gguf(lm, path: Path) -> Path:
    """Write `lm` (a random family model, float32) to `path` as an F32 GGUF of its architecture."""
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


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(the random family model, the same model loaded from a GGUF of it), the conversion in a
    $POSITRONIC_CACHE of its own."""
    family = request.param
    original = load_model(f"random:{family}", device="cpu", dtype="float32")
    folder = tmp_path_factory.mktemp(f"gguf-{family}")
    path = write_gguf(original, folder / f"random-{family}.gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POSITRONIC_CACHE", str(folder / "cache"))
        loaded = load_model(str(path), device="cpu", dtype="float32")
    return original, loaded, folder


def test_a_gguf_of_a_family_loads_as_the_same_model(pair):
    original, loaded, folder = pair
    family = original.model.config.model_type
    assert type(loaded.model).__name__ == type(original.model).__name__ == FAMILIES[family]
    assert list((folder / "cache").iterdir()), "converted into $POSITRONIC_CACHE"
    facts = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_positions", "bos_id", "eos_id")
    assert {f: getattr(loaded, f) for f in facts} == {f: getattr(original, f) for f in facts}
    torch.testing.assert_close(loaded.inv_freq, original.inv_freq, rtol=0, atol=0)
    ids = torch.tensor([[original.bos_id, *original.encode("The quick brown fox, é 漢")]])
    with torch.inference_mode():
        expected, got = original.model(ids).logits, loaded.model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    text = "Hello world"
    assert loaded.encode(text) == original.encode(text)
    mixed = " two  spaces\nand é 漢字 <s></s><r300>"
    assert loaded.encode(mixed) == original.encode(mixed)
    assert loaded.decode(loaded.encode(mixed)) == mixed
    assert json.loads(loaded.tokenizer.backend_tokenizer.to_str())["model"]["merges"] == []
    assert sorted(loaded.tokenizer.all_special_ids) == sorted(original.tokenizer.all_special_ids)


def test_the_brain_runs_on_a_gguf_model(pair):
    _, lm, _ = pair
    config = BrainConfig(policy="streaming", budget=64, seed=1)  # 64: streaming's 32-row recent window + room to cull
    brain = Brain.start(lm, [lm.bos_id] + lm.encode("some text " * 5), config)
    for _ in range(60):
        record = brain.step()
        assert not record.rebuilt, record
        assert record.live_length <= 64
    assert brain.state.mirror.ledger.count("culled") > 0
    brain.state.check(deep=True)
