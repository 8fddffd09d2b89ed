"""positronic/models/attention.py: on a CPU the models run SDPA with grouped-query attention kept
under a mask; it must give what transformers' own "sdpa" path gives, masked or not."""

import pytest
import torch

from positronic.state.forward import visibility_mask
from positronic.models import attention, load_model


@pytest.fixture(scope="module")
def tiny_gqa():
    """The tiny random shape has 4 query heads on 2 kv heads: grouped-query attention."""
    lm = load_model("random:tiny", device="cpu", dtype="float32")
    assert lm.num_heads != lm.num_kv_heads
    return lm


def logits(lm, implementation: str, ids, positions, mask):
    lm.model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            return lm.model(torch.tensor([ids]), position_ids=torch.tensor([positions]), attention_mask=mask).logits
    finally:
        lm.model.set_attn_implementation(attention.for_device(lm.device))


def test_cpu_models_run_the_grouped_attention(tiny_gqa):
    assert tiny_gqa.model.config._attn_implementation == attention.ATTENTION
    assert attention.for_device(torch.device("cuda")) == attention.ATTENTION_CUDA  # transformers' sdpa, tapped


@pytest.mark.parametrize("masked", [False, True])
def test_the_same_logits_as_transformers_sdpa(tiny_gqa, masked):
    ids = [1] + [(7 * i) % 200 + 3 for i in range(23)]
    positions = list(range(24))
    mask = None
    if masked:  # some keys hidden from some queries, as an inserted-token forward does
        keys = torch.tensor(positions)
        keys[5:9] = 100
        mask = visibility_mask(torch.tensor(positions), keys, torch.float32)
    ours = logits(tiny_gqa, attention.ATTENTION, ids, positions, mask)
    theirs = logits(tiny_gqa, "sdpa", ids, positions, mask)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    tapped = logits(tiny_gqa, attention.ATTENTION_CUDA, ids, positions, mask)  # what a GPU runs
    torch.testing.assert_close(tapped, theirs, atol=0, rtol=0)


@pytest.mark.parametrize("implementation", [attention.ATTENTION, attention.ATTENTION_CUDA])
def test_the_tap_sees_each_chosen_layers_rotated_query_and_keys_and_nothing_outside(tiny_gqa, implementation):
    ids, seen = [1, 40, 41, 42], []
    tiny_gqa.model.set_attn_implementation(implementation)
    try:
        with attention.tap(lambda module, q, k, v, scaling: seen.append((module.layer_idx, q, k, scaling)), [1]):
            with torch.no_grad():
                tiny_gqa.model(torch.tensor([ids]))
        with torch.no_grad():  # outside the tap: nothing is recorded
            tiny_gqa.model(torch.tensor([ids]))
    finally:
        tiny_gqa.model.set_attn_implementation(attention.for_device(tiny_gqa.device))
    assert [s[0] for s in seen] == [1]
    _, query, key, scaling = seen[0]
    assert query.shape == (1, tiny_gqa.num_heads, 4, tiny_gqa.head_dim)
    assert key.shape == (1, tiny_gqa.num_kv_heads, 4, tiny_gqa.head_dim)
    assert scaling == tiny_gqa.head_dim ** -0.5


@pytest.mark.parametrize("masked", [False, True])
def test_asking_for_the_normalisers_changes_no_logit_and_gives_each_querys_logsumexp(tiny_gqa, masked):
    """With `norms`, the CPU attention calls SDPA's kernel directly for its logsumexp: the
    logits are the same bit for bit, and each query head's log-normaliser is
    log Σ exp(q·k · scaling) over the keys it sees."""
    ids, positions = [1] + [(5 * i) % 90 + 3 for i in range(11)], list(range(12))
    mask = None
    if masked:
        keys = torch.tensor(positions)
        keys[3:6] = 100  # hidden from every query
        mask = visibility_mask(torch.tensor(positions), keys, torch.float32)
    seen, norms = {}, {}
    plain = logits(tiny_gqa, attention.ATTENTION, ids, positions, mask)
    with attention.tap(lambda module, q, k, v, scaling: seen.setdefault(module.layer_idx, (q, k, scaling)), [0, 1],
                       norms=lambda module, log_norm: norms.setdefault(module.layer_idx, log_norm)):
        tapped = logits(tiny_gqa, attention.ATTENTION, ids, positions, mask)
    assert torch.equal(plain, tapped)
    assert sorted(norms) == [0, 1]
    for layer, (query, key, scaling) in seen.items():
        group = query.shape[1] // key.shape[1]
        scores = (query @ key.repeat_interleave(group, dim=1).transpose(-1, -2)) * scaling
        if mask is not None:
            scores = scores + mask
        else:
            scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(norms[layer], scores.logsumexp(dim=-1), rtol=1e-5, atol=1e-5)


def test_without_the_fused_kernel_the_normalisers_are_not_given(tiny_gqa):
    """A boolean mask goes through torch's own SDPA, which gives no logsumexp: `norms` is not
    called (the attention row then reads the keys itself)."""
    norms = []
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    with attention.tap(lambda *args: None, norms=lambda module, log_norm: norms.append(module.layer_idx)):
        logits(tiny_gqa, attention.ATTENTION, [1, 5, 6, 7], [0, 1, 2, 3], mask)
    assert norms == []


def test_the_traced_decode_attention_computes_what_decode_attention_does():
    """A compiled round's attention written as loops (int8-weight-only on a CPU) against the
    eager round's: the same output, shares and log-normalisers, rows past each slot's length
    hidden (their shares 0)."""
    torch.manual_seed(0)
    slots, kv_heads, group, capacity, head_dim = 3, 2, 3, 40, 16
    rows = attention.Decode(torch.randn(slots, kv_heads, capacity, head_dim), torch.randn(slots, kv_heads, capacity, head_dim),
                            attention.decode_mask(torch.tensor([39, 7, 20]), capacity, torch.float32))
    query = torch.randn(slots, kv_heads * group, 1, head_dim)
    out, log_norm = attention.decode_attention(query, rows, 0.25)
    traced, shares, traced_norm = attention.traced_decode_attention(query, rows, 0.25)
    weights, _ = attention.decode_weights(query, rows, 0.25)
    assert torch.allclose(traced.reshape(out.shape), out, atol=1e-6)
    assert torch.allclose(shares, weights, atol=1e-7) and torch.allclose(traced_norm, log_norm, atol=1e-6)
    assert shares[1, ..., 8:].abs().max() == 0 and shares[2, ..., 21:].abs().max() == 0
    assert torch.allclose(shares.sum(-1), torch.ones(slots, kv_heads, group))
