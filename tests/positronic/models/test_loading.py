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
