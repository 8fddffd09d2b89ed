"""int4h's key centres (positronic/kv/centres.py): the mean pre-RoPE key of every layer and
kv head, from one prefill of the package's own text, once per model."""

import torch
from transformers import DynamicCache

from positronic.kv import rope
from positronic.kv.centres import CALIBRATION_TOKENS, compute_key_centres, key_centres
from positronic.texts import DEFAULT_TEXT
from positronic.models import with_cache


def test_centres_are_the_mean_key_before_rope(tiny):
    ids = [tiny.bos_id] + list(range(10, 60))
    centres = compute_key_centres(tiny, ids)
    assert centres.shape == (tiny.num_layers, tiny.num_kv_heads, tiny.head_dim) and centres.dtype == torch.float32
    cache = DynamicCache(config=tiny.model.config)
    with torch.no_grad():
        tiny.model(torch.tensor([ids]), **with_cache(cache), use_cache=True)
    positions = torch.arange(len(ids))
    cos, sin = rope.rotation(tiny.inv_freq, positions, torch.zeros_like(positions))  # each key back to position 0
    for layer in range(tiny.num_layers):
        keys = cache.layers[layer].keys[0]  # [kv_heads, n, head_dim], rotated to their positions
        torch.testing.assert_close(centres[layer], rope.rotate(keys, cos, sin).mean(dim=1))
        assert not torch.allclose(centres[layer], keys.mean(dim=1), atol=1e-3), "not the mean of rotated keys"


def test_key_centres_are_computed_once_per_model_from_the_package_text(tiny, monkeypatch):
    first = key_centres(tiny)
    calls = []
    monkeypatch.setattr("positronic.kv.centres.compute_key_centres", lambda *args: calls.append(args))
    assert key_centres(tiny) is first and not calls
    ids = [tiny.bos_id] + tiny.encode(DEFAULT_TEXT.read_text(encoding="utf-8"))
    torch.testing.assert_close(first, compute_key_centres(tiny, ids[:CALIBRATION_TOKENS]))
