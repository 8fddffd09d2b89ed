"""positronic.models.random_models: random:tiny's shape, weights, SDPA vs eager, byte tokenizer."""


import torch
from hypothesis import given, settings, strategies as st

from positronic.models import attention, load_model


def test_random_tiny_facts(tiny, expected_inv_freq):
    assert (tiny.name, tiny.device, tiny.dtype) == ("random:tiny", torch.device("cpu"), torch.float32)
    assert (tiny.num_layers, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim) == (2, 4, 2, 16)
    assert (tiny.vocab_size, tiny.max_positions, tiny.bos_id, tiny.eos_id) == (512, 512, 1, 2)
    assert tiny.inv_freq.dtype == torch.float32 and tiny.inv_freq.device.type == "cpu"
    torch.testing.assert_close(tiny.inv_freq, expected_inv_freq(10000.0, 16), rtol=0, atol=0)
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert tiny.model.config._attn_implementation == attention.ATTENTION  # SDPA, grouped-query under a mask too
    assert tiny.model.model.embed_tokens.weight.shape == (512, 64)


def test_random_tiny_runs_sdpa_and_its_attention_row_matches_eager(tiny, eager_forward):
    """The model runs SDPA (no attention weights); what eager attention would return for the
    newest token is computed on the side (positronic.state.forward), equal to eager's."""
    from positronic.kv.cache import SpliceCache
    from positronic.state.forward import forward

    ids = [tiny.bos_id, *tiny.encode("abcdef")]
    with torch.inference_mode():
        sdpa = tiny.model(torch.tensor([ids]))
    assert sdpa.logits.shape == (1, 7, 512) and torch.isfinite(sdpa.logits).all()
    eager = eager_forward(tiny, ids)
    assert tiny.model.config._attn_implementation == attention.ATTENTION  # SDPA, grouped-query under a mask too
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
