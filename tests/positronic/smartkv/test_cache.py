"""SmartKVCache (positronic/smartkv/cache.py) inside a real model.

The position tests compare a pruned cache with references built without it: the same model
fed the kept rows (taken from a full cache) with explicit position_ids, either through a 4-D
mask over a full DynamicCache (when every layer keeps the same rows) or through a DynamicCache
gathered per layer (when the gates make layers keep different rows).
"""

import math
import random

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from positronic.smartkv import GateFileError, GateSet, SmartKVCache
from positronic.smartkv.labels import KeyUnrotator
from positronic.smartkv.rows import RowBook
from positronic.models import with_cache


class PositionScorer:
    """Scores that depend only on the position (the same in every layer), pseudo-random."""

    def score(self, layer, keys, positions):
        return torch.tensor([math.sin(7.3 * p + 1.1) for p in positions.tolist()])


def text_ids(lm, count, seed=0):
    rng = random.Random(seed)
    return [lm.bos_id] + [rng.randrange(3, min(lm.vocab_size, 259)) for _ in range(count - 1)]


def full_cache(lm, ids):
    """A DynamicCache over all of `ids` (one prefill) and the logits of its last token."""
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        out = lm.model(torch.tensor([ids]), **with_cache(cache), use_cache=True)
    return cache, out.logits[0, -1]


def gathered(lm, store: list[tuple[torch.Tensor, torch.Tensor]], kept: list[torch.Tensor]) -> DynamicCache:
    """A DynamicCache whose layer l holds rows `kept[l]` (positions [n], or [kv_heads, n]: each
    kv head its own) of store[l] (K, V over all positions)."""
    cache = DynamicCache(config=lm.model.config)
    for l, (k, v) in enumerate(store):
        rows = kept[l] if kept[l].dim() == 2 else kept[l].expand(k.shape[1], -1)
        index = rows[None, :, :, None].expand(1, -1, -1, k.shape[3])
        cache.update(k.gather(2, index), v.gather(2, index), l)
    return cache


def step_reference(lm, store, kept, token, position):
    """Logits of `token` at `position` attending exactly to rows `kept[l]` of every layer, plus
    its new K/V appended to `store` (so the next step can use them)."""
    cache = gathered(lm, store, kept)
    with torch.no_grad():
        out = lm.model(torch.tensor([[token]]), **with_cache(cache), use_cache=True,
                       position_ids=torch.tensor([[position]]))
    for l in range(len(store)):
        k, v = store[l]
        new_k, new_v = cache.layers[l].keys[:, :, -1:], cache.layers[l].values[:, :, -1:]
        store[l] = (torch.cat([k, new_k], 2), torch.cat([v, new_v], 2))
    return out.logits[0, -1]


def store_of(cache: DynamicCache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def kept_before(cache, layers, n, heads=1):
    """Per layer, the positions a decoded token at position n attended to besides itself:
    what the layer holds after admitting it (a decoded token is admitted first), less n
    ([rows - 1], or with heads > 1 [heads, rows - 1]: per kv head)."""
    def without_n(positions):
        return positions[positions != n]
    if heads == 1:
        return [without_n(cache.positions(l)) for l in range(layers)]
    return [torch.stack([without_n(cache.positions(l, h)) for h in range(heads)]) for l in range(layers)]


def smart_step(lm, cache, token):
    with torch.no_grad():
        return lm.model(torch.tensor([[token]]), **with_cache(cache), use_cache=True).logits[0, -1]


# --- the cache inside the model ---------------------------------------------------------------

def test_identical_logits_to_dynamic_cache_while_nothing_is_pruned(tiny):
    ids = torch.tensor([text_ids(tiny, 20)])
    gates = GateSet.for_config(tiny.model.config, seed=3)
    runs = []
    for cache in (DynamicCache(config=tiny.model.config), SmartKVCache(tiny.model.config, gates, budget=16)):
        out = tiny.model.generate(ids, **with_cache(cache), max_new_tokens=12, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        runs.append(out)
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].logits, runs[1].logits):
        assert torch.equal(a, b)


def test_pruned_cache_matches_a_masked_full_forward_over_the_kept_rows(tiny):
    """Every layer keeps the same rows (a position-only scorer, value norms left out): the
    reference is one full DynamicCache with a 4-D mask hiding the dropped rows and explicit
    position_ids."""
    ids = text_ids(tiny, 60)
    cache = SmartKVCache(tiny.model.config, scorer=PositionScorer(), sinks=3, budget=9, window=5, value_norms=False)
    with torch.no_grad():
        tiny.model(torch.tensor([ids[:40]]), **with_cache(cache), use_cache=True)
    reference, _ = full_cache(tiny, ids[:40])
    assert cache.rows == 17 and cache.seen == 40
    for n in range(40, 60):
        got = smart_step(tiny, cache, ids[n])
        kept = cache.positions(0)  # what the token attended to: admitted first, so itself included
        for l in range(1, tiny.num_layers):
            assert torch.equal(cache.positions(l), kept)  # same rows everywhere: one mask is right
        assert len(set(kept.tolist())) == 17 and {0, n} <= set(kept.tolist())
        mask = torch.full((1, 1, 1, n + 1), float("-inf"))
        mask[..., kept] = 0.0
        with torch.no_grad():
            want = tiny.model(torch.tensor([[ids[n]]]), **with_cache(reference), use_cache=True,
                              position_ids=torch.tensor([[n]]), attention_mask=mask).logits[0, -1]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        assert cache.rows == 17 and cache.seen == n + 1


@pytest.mark.parametrize("per_head", [False, True])
def test_pruned_cache_matches_each_lanes_kept_rows_at_their_positions(tiny, per_head):
    """Gates make the layers (per-head gates: the kv heads of a layer too) keep different rows:
    the reference gathers each layer's (each head's) kept rows from the full K/V and feeds the
    next token at its real position. The prefill is admitted at once (each lane writes its own
    kept rows), the rest one token at a time."""
    ids = text_ids(tiny, 70, seed=4 if per_head else 2)
    gates = GateSet.for_config(tiny.model.config, seed=6 if per_head else 5, per_head=per_head)
    heads = gates.heads
    assert heads == (tiny.model.config.num_key_value_heads if per_head else 1)
    cache = SmartKVCache(tiny.model.config, gates, sinks=2, budget=10, window=4)
    with torch.no_grad():
        tiny.model(torch.tensor([ids[:45]]), **with_cache(cache), use_cache=True)
    full, _ = full_cache(tiny, ids[:45])
    store = store_of(full)
    differ = False
    for n in range(45, 70):
        got = smart_step(tiny, cache, ids[n])
        kept = kept_before(cache, tiny.num_layers, n, heads)
        if per_head:  # the kv heads of one layer
            assert {tuple(k.shape) for k in kept} == {(heads, 15)}
            differ |= any(set(k[0].tolist()) != set(k[1].tolist()) for k in kept)
        else:
            differ |= any(set(k.tolist()) != set(kept[0].tolist()) for k in kept)
        want = step_reference(tiny, store, kept, ids[n], n)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert differ, f"random gates should make the {'heads of a layer' if per_head else 'two layers'} keep different rows"


def test_wrong_positions_would_be_caught(tiny):
    """The reference is sensitive: feeding the next token at the row count instead of the
    token count changes the logits."""
    ids = text_ids(tiny, 50)
    cache = SmartKVCache.streaming(tiny.model.config, capacity=12, sinks=2)
    with torch.no_grad():
        tiny.model(torch.tensor([ids[:49]]), **with_cache(cache), use_cache=True)
    full, _ = full_cache(tiny, ids[:49])
    got = smart_step(tiny, cache, ids[49])
    kept = kept_before(cache, tiny.num_layers, 49)
    right = step_reference(tiny, store_of(full), kept, ids[49], 49)
    wrong = step_reference(tiny, store_of(full), kept, ids[49], 12)
    torch.testing.assert_close(got, right, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(got, wrong, atol=1e-3)


def test_generate_derives_positions_from_tokens_seen(tiny):
    """model.generate with a SmartKVCache that prunes during prefill and decoding gives the
    greedy tokens and logits of a reference fed explicit positions over the kept rows."""
    ids = text_ids(tiny, 30, seed=4)
    gates = GateSet.for_config(tiny.model.config, seed=7)
    cache = SmartKVCache(tiny.model.config, gates, sinks=2, budget=6, window=4)
    out = tiny.model.generate(torch.tensor([ids]), **with_cache(cache), max_new_tokens=15, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    assert cache.seen == 30 + 14 and cache.rows == 12  # the last generated token is never fed
    # replay: the same cache settings, driven by hand, against the gathered reference
    replay = SmartKVCache(tiny.model.config, gates, sinks=2, budget=6, window=4)
    full, last = full_cache(tiny, ids)
    with torch.no_grad():
        first = tiny.model(torch.tensor([ids]), **with_cache(replay), use_cache=True).logits[0, -1]
    torch.testing.assert_close(first, last, atol=2e-5, rtol=1e-5)  # the prefill attends to everything
    store = store_of(full)
    sequence = out.sequences[0].tolist()
    torch.testing.assert_close(out.logits[0][0], first, atol=2e-5, rtol=1e-5)
    for step in range(1, 15):
        n = 30 + step - 1
        got = smart_step(tiny, replay, sequence[n])
        want = step_reference(tiny, store, kept_before(replay, tiny.num_layers, n), sequence[n], n)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out.logits[step][0], want, atol=2e-5, rtol=1e-5)
        assert int(want.argmax()) == sequence[n + 1]


def test_every_layer_holds_the_same_number_of_rows(tiny):
    gates = GateSet.for_config(tiny.model.config, seed=11)
    cache = SmartKVCache(tiny.model.config, gates, sinks=4, budget=12, window=8)
    ids = text_ids(tiny, 80, seed=6)
    with torch.no_grad():
        for n, token in enumerate(ids):
            tiny.model(torch.tensor([[token]]), **with_cache(cache), use_cache=True)
            counts = {layer.keys.shape[2] for layer in cache.layers} | {layer.values.shape[2] for layer in cache.layers}
            assert counts == {min(n + 1, 24)}
    assert cache.get_seq_length() == 80 and cache.rows == 24


@pytest.mark.parametrize("per_head", [False, True])
def test_manual_bulk_prune_keeps_what_auto_keeps(tiny, per_head):
    ids = text_ids(tiny, 50, seed=8)
    gates = GateSet.for_config(tiny.model.config, seed=9, per_head=per_head)
    auto = SmartKVCache(tiny.model.config, gates, sinks=2, budget=8, window=6)
    manual = SmartKVCache(tiny.model.config, gates, sinks=2, budget=8, window=6, prune="manual")
    with torch.no_grad():
        for cache in (auto, manual):
            tiny.model(torch.tensor([ids[:40]]), **with_cache(cache), use_cache=True)
    assert manual.rows == 40 and auto.rows == 16
    manual.bulk_prune()
    assert manual.rows == 16
    for l in range(tiny.num_layers):
        for h in range(gates.heads):
            assert sorted(manual.positions(l, h).tolist()) == sorted(auto.positions(l, h).tolist())
    for token in ids[40:]:  # from here both prune as tokens arrive, and agree
        torch.testing.assert_close(smart_step(tiny, manual, token), smart_step(tiny, auto, token), atol=1e-5, rtol=1e-5)
    out = tiny.model.generate(torch.tensor([ids]), **with_cache(manual), max_new_tokens=3, do_sample=False,
                              pad_token_id=0)
    assert out.shape[1] == 53 and manual.rows == 16


def test_keys_are_unrotated_to_what_k_proj_wrote(tiny):
    ids = torch.tensor([text_ids(tiny, 24)])
    seen = {}
    attn = tiny.model.model.layers[1].self_attn
    handle = attn.k_proj.register_forward_hook(lambda m, i, o: seen.setdefault("k", o[0].clone()))
    try:
        cache, _ = full_cache(tiny, ids[0].tolist())
    finally:
        handle.remove()
    plain = KeyUnrotator.for_config(tiny.model.config)(cache.layers[1].keys, torch.arange(24))
    torch.testing.assert_close(plain, seen["k"], atol=1e-5, rtol=1e-5)


def test_cache_refuses_what_it_cannot_do(tiny):
    config = tiny.model.config
    with pytest.raises(ValueError, match="needs gates"):
        SmartKVCache(config, budget=8)
    with pytest.raises(ValueError, match="prune"):
        SmartKVCache(config, budget=0, window=8, prune="sometimes")
    with pytest.raises(ValueError, match="needs its window size"):
        SmartKVCache(config, budget=0)
    assert SmartKVCache(config, GateSet.for_config(config), budget=12, sinks=4).window == 16  # half the capacity
    other = GateSet.new(3, 32)
    with pytest.raises(GateFileError, match="this model has 2 layers"):
        SmartKVCache(config, other, budget=8)
    with pytest.raises(GateFileError, match="score 3 heads per layer; this model has 2 kv heads"):
        SmartKVCache(config, GateSet.new(2, 32, heads=3), budget=8)
    cache = SmartKVCache.streaming(config, capacity=8)
    with pytest.raises(ValueError, match="one sequence"):
        with torch.no_grad():
            tiny.model(torch.tensor([text_ids(tiny, 5)] * 2), **with_cache(cache), use_cache=True)


# --- the real model ---------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_with_shipped_gates_prunes_with_correct_positions(smol):
    gates = GateSet.for_model("smollm2")
    ids = [smol.bos_id] + smol.encode(
        "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing "
        "to do: once or twice she had peeped into the book her sister was reading, but it had no pictures "
        "or conversations in it, and what is the use of a book, thought Alice, without pictures?")
    prompt = len(ids) - 6
    cache = SmartKVCache(smol.model.config, gates, sinks=4, budget=16, window=8)
    with torch.no_grad():
        smol.model(torch.tensor([ids[:prompt]]), **with_cache(cache), use_cache=True)
    full, _ = full_cache(smol, ids[:prompt])
    store = store_of(full)
    for n in range(prompt, len(ids)):
        got = smart_step(smol, cache, ids[n])
        want = step_reference(smol, store, kept_before(cache, smol.num_layers, n, gates.heads), ids[n], n)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert gates.heads == smol.model.config.num_key_value_heads == 3, "the shipped gates score per kv head"
    assert {layer.keys.shape[2] for layer in cache.layers} == {28}
    lanes = {tuple(sorted(cache.positions(l, h).tolist())) for l in range(smol.num_layers) for h in range(3)}
    assert len(lanes) > 1


class CountingScorer:
    """Gate scores (random gates) that count the calls and the keys they were given."""

    def __init__(self, gates):
        self.gates, self.calls, self.keys = gates, 0, 0
        self.heads = gates.heads

    def score(self, layer, keys, positions):
        self.calls += 1
        self.keys += keys.shape[0]
        return self.gates.score(layer, keys)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("value_norms", [False, True])
def test_decoding_scores_lazily_in_batches_and_keeps_what_eager_scores_keep(tiny, value_norms, per_head):
    """A decoded token is scored only when it is about to leave the window, with the other
    unscored window rows in one call; the rows kept are those a RowBook given every token's
    score up front keeps: the gate's score of the pre-RoPE key k_proj wrote, plus (value_norms)
    log4 of the norm of the value row v_proj wrote (per-head lanes: each kv head's own; one
    lane per layer: of the mean over the kv heads)."""
    gates = GateSet.for_config(tiny.model.config, seed=13, per_head=per_head)
    scorer = CountingScorer(gates)
    sinks, budget, window, count = 3, 10, 8, 90
    cache = SmartKVCache(tiny.model.config, scorer=scorer, sinks=sinks, budget=budget, window=window,
                         value_norms=value_norms)
    ids = text_ids(tiny, count, seed=12)
    layers = tiny.num_layers
    written = [([], []) for _ in range(layers)]  # per layer: k_proj's and v_proj's outputs, one per token
    hooks = [projection.register_forward_hook(lambda module, inputs, output, into=into: into.append(output[0, 0]))
             for layer, (keys, values) in zip(tiny.model.model.layers, written)
             for projection, into in ((layer.self_attn.k_proj, keys), (layer.self_attn.v_proj, values))]
    try:
        for token in ids:
            smart_step(tiny, cache, token)
    finally:
        for hook in hooks:
            hook.remove()
    # every token that left the window was scored, none twice (batches may score some of the last window's)
    assert layers * (count - sinks - window) <= scorer.keys <= layers * (count - sinks)
    assert scorer.calls <= layers * (count // window + 1), "one call per layer per window, not per token"
    kv_heads, heads = tiny.model.config.num_key_value_heads, gates.heads

    def eager_kept(with_values):
        scores = []  # per lane (layer-major)
        for l, (keys, values) in enumerate(written):
            score = gates.score(l, torch.stack(keys))  # [count, heads]
            if with_values:
                norms = torch.stack(values).view(count, kv_heads, -1).norm(dim=-1)  # [count, kv_heads]
                score = score + (norms if per_head else norms.mean(1, keepdim=True)).log() / math.log(4)
            scores.extend(score.double().numpy().T)
        eager = RowBook(layers * heads, sinks, budget, window)
        eager.admit(list(range(count)), np.stack(scores))
        return [sorted(eager.positions(lane)) for lane in range(layers * heads)]

    held = [sorted(cache.positions(l, h).tolist()) for l in range(layers) for h in range(heads)]
    assert held == eager_kept(value_norms)
    assert eager_kept(True) != eager_kept(False), "the value norms should change what this cache keeps"
