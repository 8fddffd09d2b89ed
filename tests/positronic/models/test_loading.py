"""positronic.models.loading: names, local directories, the hub, dtype and device, one-line refusals."""


import pytest
import torch
import transformers

import positronic.models.loading
from positronic import models
from positronic.models import ModelError, ModelNotAvailable, load_model


def test_local_directory_round_trip(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.vocab_size, loaded.bos_id) == (2, 2, 512, 1)
    assert loaded.encode("héllo") == tiny.encode("héllo")
    ids = torch.tensor([[1, *tiny.encode("round trip")]])
    assert torch.equal(loaded.model(ids).logits, tiny.model(ids).logits)


def test_unknown_names_are_refused(one_line_error):
    assert "unknown model 'no-such-model'" in one_line_error(ModelError, "no-such-model")
    assert "random:tiny" in one_line_error(ModelError, "random:enormous")


def test_tinyllama_not_present_is_a_clear_error(monkeypatch, one_line_error):
    from huggingface_hub import try_to_load_from_cache
    if isinstance(try_to_load_from_cache(models.TINYLLAMA_ID, "config.json"), str):
        pytest.skip("TinyLlama is in the local Hugging Face cache")
    monkeypatch.setattr(positronic.models.loading, "_hub_reachable", lambda: False)  # never download 2 GB in a test
    message = one_line_error(ModelNotAvailable, "tinyllama")
    assert models.TINYLLAMA_ID in message and "hf download" in message and "smollm2" in message


def test_hub_failure_is_one_line(monkeypatch, one_line_error):
    def fail(*args, **kwargs):
        raise OSError("first line\nsecond line")
    monkeypatch.setattr(positronic.models.loading, "_hub_reachable", lambda: True)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fail)
    message = one_line_error(ModelNotAvailable, "someone/some-llama")
    assert "first line second line" in message


def test_hub_is_not_probed_when_offline(monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert positronic.models.loading._hub_reachable() is False


def test_bad_dtype_and_device_are_refused(one_line_error):
    assert "bad dtype 'int8'" in one_line_error(ModelError, "random:tiny", dtype="int8")
    assert "bad dtype" in one_line_error(ModelError, "random:tiny", dtype=torch.int64)
    assert "bad device" in one_line_error(ModelError, "random:tiny", device="banana")
    if not torch.cuda.is_available():
        assert "CUDA" in one_line_error(ModelError, "random:tiny", device="cuda")


def _saved(lm, directory):
    lm.model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    return str(directory)


def test_dtype_auto_keeps_the_checkpoint_dtype(tmp_path):
    half = _saved(load_model("random:qwen3", device="cpu", dtype="bfloat16"), tmp_path / "bf16")
    loaded = load_model(half, device="cpu", dtype="auto")
    assert loaded.dtype == torch.bfloat16, "a bf16 checkpoint stays bf16"
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert load_model(half, device="cpu", dtype="AUTO").dtype == torch.bfloat16
    asked = load_model(half, device="cpu", dtype="float32")
    assert asked.dtype == torch.float32 and {p.dtype for p in asked.model.parameters()} == {torch.float32}
    full = _saved(load_model("random:qwen3", device="cpu", dtype="float32"), tmp_path / "fp32")
    assert load_model(full, device="cpu", dtype="auto").dtype == torch.float32


def test_dtype_auto_of_a_random_model_is_the_device_default():
    assert load_model("random:tiny", device="cpu", dtype="auto").dtype == torch.float32


@pytest.mark.parametrize("family", sorted(models.FAMILY_SHAPES))
def test_each_family_round_trips_through_a_local_directory(family, tmp_path):
    original = load_model(f"random:{family}", device="cpu", dtype="float32")
    loaded = load_model(_saved(original, tmp_path), device="cpu", dtype="auto")
    assert type(loaded.model) is type(original.model), "loaded as its own family's class"
    assert loaded.dtype == torch.float32
    facts = lambda lm: (lm.num_layers, lm.num_heads, lm.num_kv_heads, lm.head_dim, lm.vocab_size, lm.bos_id,
                        lm.max_positions)
    assert facts(loaded) == facts(original)
    assert torch.equal(loaded.inv_freq, original.inv_freq)
    assert loaded.encode("round trip") == original.encode("round trip")
    ids = torch.tensor([[original.bos_id, *original.encode("round trip")]])
    assert torch.equal(loaded.model(ids).logits, original.model(ids).logits)


def _damaged(tiny, directory, change):
    """random:tiny saved to `directory`, its safetensors changed by change(tensors) (name -> tensor)."""
    import safetensors.torch
    _saved(tiny, directory)
    tensors = safetensors.torch.load_file(directory / "model.safetensors")
    change(tensors)
    safetensors.torch.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return str(directory)


def test_a_directory_lacking_a_tensor_is_refused_naming_it(tiny, tmp_path, one_line_error):
    """transformers initialised the missing tensor at random and said so in a log line the
    project mutes: exit 0, made-up weights."""
    path = _damaged(tiny, tmp_path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    message = one_line_error(ModelError, path, device="cpu")
    assert "lacks tensor model.layers.1.mlp.down_proj.weight, which the model needs" in message


def test_a_directory_tensor_of_another_shape_is_refused_naming_it(tiny, tmp_path, one_line_error):
    path = _damaged(tiny, tmp_path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 32)}))
    message = one_line_error(ModelError, path, device="cpu")
    assert "tensor model.layers.0.mlp.up_proj.weight has shape [128, 32], its config makes it [128, 64]" in message


def test_a_directory_tensor_the_model_does_not_use_is_refused_naming_it(tiny, tmp_path, one_line_error):
    """A config of fewer layers than the checkpoint holds loaded the first ones and dropped the rest."""
    path = _damaged(tiny, tmp_path, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}))
    message = one_line_error(ModelError, path, device="cpu")
    assert "holds tensor model.layers.2.mlp.up_proj.weight, which the model does not use" in message


def test_a_directory_config_that_lies_about_sizes_is_refused_before_allocating(tiny, tmp_path, one_line_error):
    """hidden_size 65536 with vocab 2^20: transformers allocated 64 GB before failing."""
    import json
    import time
    path = _saved(tiny, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 65536, "vocab_size": 2**20,
                                                      "intermediate_size": 2**18}))
    start = time.perf_counter()
    message = one_line_error(ModelError, path, device="cpu")
    assert "tensor model.embed_tokens.weight has shape [512, 64], its config makes it [1048576, 65536]" in message
    assert time.perf_counter() - start < 2
    (tmp_path / "config.json").write_text(json.dumps({**config, "bos_token_id": 2**31 - 1}))
    assert "bos_token_id = 2147483647 is not a token id" in one_line_error(ModelError, path, device="cpu")


@pytest.mark.slow
def test_a_gguf_file_loads_like_the_embedded_model_and_converts_once(smol, tmp_path, monkeypatch, capfd):
    gguf = str(models.smollm2_gguf())  # before the cache moves: the fetched file lies in the user's
    monkeypatch.setenv("POSITRONIC_CACHE", str(tmp_path))
    capfd.readouterr()
    lm = load_model(gguf, device="cpu", weights="float32")  # the de-quantized file: the embedded model's numbers
    assert "converting" in capfd.readouterr().err
    (converted,) = tmp_path.glob("gguf-*")  # in $POSITRONIC_CACHE, not the user's cache
    assert lm.name == gguf and lm.dtype == torch.float32
    assert (lm.vocab_size, lm.num_layers, lm.num_kv_heads, lm.head_dim, lm.bos_id, lm.eos_id) == \
        (smol.vocab_size, smol.num_layers, smol.num_kv_heads, smol.head_dim, smol.bos_id, smol.eos_id)
    assert lm.encode("Hello world") == smol.encode("Hello world")
    ids = torch.tensor([[smol.bos_id, *smol.encode("The capital of France is")]])
    with torch.inference_mode():
        got, want = lm.model(ids).logits[0], smol.model(ids).logits[0]
    assert torch.allclose(got, want, atol=1e-4, rtol=0), "every row, the last one the first generated token's"
    assert got[-1].argmax() == want[-1].argmax()

    stamp = {f.name: f.stat().st_mtime_ns for f in converted.iterdir()}
    again = load_model(gguf, device="cpu")
    assert "converting" not in capfd.readouterr().err, "the second load reads the converted directory"
    assert again.weights == "int8", "a quantized GGUF runs int8 unless asked otherwise (docs/weights.md)"
    assert {f.name: f.stat().st_mtime_ns for f in converted.iterdir()} == stamp
    assert again.encode("Hello world") == lm.encode("Hello world")


def test_a_missing_or_unreadable_gguf_file_is_refused(tmp_path, one_line_error):
    missing = str(tmp_path / "x.gguf")
    assert "does not exist or is not a regular file" in one_line_error(ModelError, missing, device="cpu")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a GGUF file\n" * 8)
    message = one_line_error(ModelError, str(bad), device="cpu")
    assert "cannot read GGUF file" in message and "bad.gguf" in message


@pytest.mark.long
def test_a_hub_id_loads_from_the_local_hugging_face_cache_offline(tmp_path):
    """What a user who ran `hf download Qwen/Qwen3-0.6B` has: the model under the hub cache's
    models--org--name/snapshots/<commit>/ layout. `run.py --model org/name` finds it there with
    the hub unreachable (HF_HUB_OFFLINE=1), in a fresh process that reads HF_HUB_CACHE."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--tiny-qwen3"
    _saved(load_model("random:qwen3", device="cpu"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run([sys.executable, str(root / "run.py"), "--model", "someorg/tiny-qwen3", "--ticks", "3",
                             "-c", "64", "--no-tui", "--no-input"], capture_output=True, text=True, env=env,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[3/3] tick 3" in result.stderr
    missing = subprocess.run([sys.executable, str(root / "run.py"), "--model", "someorg/absent", "--ticks", "3",
                              "--no-tui", "--no-input"], capture_output=True, text=True, env=env, timeout=300,
                             cwd=tmp_path)
    assert missing.returncode != 0 and "hf download someorg/absent" in missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.parametrize("text", ["hello world", " " * 300, "\n\n\n" * 50, "ééé 漢字 🙂" * 20, "<|im_start|>" * 9,
                                  "abc" * 1000, "".join(chr(i) for i in range(32, 3000))])
def test_fewest_tokens_never_exceeds_the_real_count(smol, tiny, text):
    """What `run` checks a prompt with before encoding it: a lower bound, for a BPE tokenizer
    (SmolLM2's) and the byte tokenizer alike."""
    for lm in (smol, tiny):
        assert 1 <= lm.fewest_tokens(text) <= len(lm.encode(text))
    assert tiny.fewest_tokens("x" * 6_000_000) == 1_000_000  # the longest entry, "<rNNN>", is 6 characters
