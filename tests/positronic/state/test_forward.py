"""The forward (positronic/state/forward.py): one forward per tick whose new rows and logits equal a
plain forward per new row, the attention row equal to eager attention, probes that score a
token in its left context without changing the tick, the mask built from positions, and
layer 0's K/V computed from scratch.

The references are plain transformers: DynamicCache forwards and eager attention."""

import pytest
import torch
from transformers import DynamicCache

from positronic.kv.cache import SpliceCache
from positronic.state.forward import Probes, forward, fresh_layer0_kv, prefill, visibility_mask
from positronic.state.manager import StateManager
from positronic.models import with_cache

PROMPT = "The old lighthouse keeper climbed the spiral stairs every night, counting each step as the storm grew louder."


def oracle_row(lm, sm, row):
    """K/V of live row `row` in every layer, and its next-token logits, computed the plain way:
    one forward of that token alone over a DynamicCache (torch.cat) holding rows [0, row) as
    the spliced cache has them — its own left context, nothing to its right."""
    cache = DynamicCache()
    for index in range(lm.num_layers):
        keys, values = sm.layer_kv(index)
        cache.update(keys[:, :, :row], values[:, :, :row], index)
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([[sm.live_token_ids()[row]]]),
                       position_ids=torch.tensor([[sm.positions()[row]]]), **with_cache(cache), use_cache=True)
    return [(layer.keys[:, :, -1:], layer.values[:, :, -1:]) for layer in cache.layers], out.logits[0, -1].float()


def test_one_forward_tick_equals_one_forward_per_new_row(smol):
    """Two replacements and a new token share one forward; each new row's K/V in every layer
    equal a separate forward of that token over exactly the rows left of it, and the new
    token's logits equal its own forward's."""
    sm = StateManager.from_tokens(smol, [smol.bos_id] + smol.encode(PROMPT))
    n = len(sm)
    report = sm.apply([{"action": "replace_pair", "original_pos1": 5, "original_pos2": 6, "new_token_ids": [1234]},
                       {"action": "replace_pair", "original_pos1": 12, "original_pos2": 13, "new_token_ids": [77, 78]},
                       {"action": "delete", "position": n - 3},
                       {"action": "add", "token_id": 42}], tick=1)
    assert not report.rebuilt and report.edits == 1
    new_rows = [5, 11, 12, len(sm) - 1]
    assert [sm.live_token_ids()[r] for r in new_rows] == [1234, 77, 78, 42]
    for row in new_rows:
        expected, logits = oracle_row(smol, sm, row)
        for index, (keys, values) in enumerate(expected):
            got_k, got_v = sm.layer_kv(index)
            torch.testing.assert_close(got_k[:, :, row : row + 1], keys, rtol=0, atol=2e-5)
            torch.testing.assert_close(got_v[:, :, row : row + 1], values, rtol=0, atol=2e-5)
    torch.testing.assert_close(sm.next_logits, logits, rtol=0, atol=1e-4)
    assert sm.view().predicted[-1] == int(logits.argmax())


def test_the_attention_row_equals_eager_attention_on_the_scored_layers(smol):
    """The SDPA-side hook gives the newest token's attention exactly as eager attention's
    `output_attentions` would, on the layers asked for and no others."""
    layers = [0, 7, smol.num_layers - 1]
    sm = StateManager.from_tokens(smol, [smol.bos_id] + smol.encode(PROMPT), score_layers=layers)
    sm.apply([{"action": "replace_pair", "original_pos1": 8, "original_pos2": 9, "new_token_ids": [500]},
              {"action": "add", "token_id": 42}], tick=1)
    assert sm.last_attention.shape == (len(layers), smol.num_heads, len(sm))
    sm_ids, positions = sm.live_token_ids(), sm.positions()
    model, n = smol.model, len(sm_ids)
    causal = torch.full((n, n), torch.finfo(smol.dtype).min).triu(1)[None, None]
    previous, model.config._attn_implementation = model.config._attn_implementation, "eager"
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([sm_ids]), position_ids=torch.tensor([positions]),
                        attention_mask=causal, output_attentions=True, use_cache=False)
    finally:
        model.config._attn_implementation = previous
    # a fresh prefill differs from the spliced cache in deeper layers, so compare with the
    # rebuilt state, whose K/V are that prefill's
    sm.rebuild()
    eager = torch.stack([out.attentions[i][0, :, -1] for i in layers]).float()
    torch.testing.assert_close(sm.last_attention, eager, rtol=0, atol=1e-5)
    assert torch.allclose(sm.last_attention.sum(-1), torch.ones(len(layers), smol.num_heads))


def test_probes_score_a_token_in_its_left_context_and_change_nothing(tiny):
    """A probe (token x at position p, target t) returns log P(t | the live rows left of p, x):
    what a plain forward of x over those rows' K/V gives (a DynamicCache holding them); the
    tick itself (cache, mirror, next logits) is the same as without probes."""
    ids = [1] + list(range(40, 70))
    probed, plain = StateManager.from_tokens(tiny, ids), StateManager.from_tokens(tiny, ids)
    edits = [{"action": "replace_pair", "original_pos1": 7, "original_pos2": 8, "new_token_ids": [300]},
             {"action": "delete", "position": 12}, {"action": "add", "token_id": 42}]
    probes = Probes(token_ids=(77, 78, 77), positions=(10, 10, 20), targets=(99, 99, 5))
    report = probed.apply(edits, probes=probes)
    plain.apply(edits)
    assert not report.rebuilt and len(report.probe_logprobs) == 3
    positions = probed.positions()
    for token, position, target, got in zip(probes.token_ids, probes.positions, probes.targets, report.probe_logprobs):
        left = torch.tensor([i for i, p in enumerate(positions) if p < position])
        cache = DynamicCache()
        for index in range(tiny.num_layers):
            keys, values = probed.layer_kv(index)
            cache.update(keys[:, :, left], values[:, :, left], index)
        with torch.inference_mode():
            logits = tiny.model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]),
                                **with_cache(cache), use_cache=True).logits[0, -1].float()
        assert got == pytest.approx(float(logits.log_softmax(-1)[target]), abs=1e-4)
    assert report.probe_logprobs[0] != pytest.approx(report.probe_logprobs[1]), "each probe is its own query"
    for index in range(tiny.num_layers):
        for a, b in zip(probed.layer_kv(index), plain.layer_kv(index)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(probed.next_logits, plain.next_logits, rtol=0, atol=1e-4)
    assert probed.live_token_ids() == plain.live_token_ids() and probed.cache.length == len(probed)
    probed.check(deep=True)
    with pytest.raises(ValueError, match="must add a token"):
        probed.apply([{"action": "delete", "position": 3}], probes=probes)


def test_the_mask_lets_a_query_see_exactly_the_rows_at_or_before_its_position():
    keys = torch.tensor([0, 1, 4, 5, 9])
    queries = torch.tensor([1, 5, 9])
    mask = visibility_mask(queries, keys, torch.float32)
    assert mask.shape == (1, 1, 3, 5) and mask.dtype == torch.float32
    seen = (mask[0, 0] == 0).tolist()
    assert seen == [[True, True, False, False, False],
                    [True, True, True, True, False],
                    [True] * 5]
    assert (mask[0, 0][~torch.tensor(seen)] == torch.finfo(torch.float32).min).all()


def test_a_probe_sees_only_the_rows_left_of_its_position_and_its_own_scratch_row():
    # live rows at positions 0, 2, 3, 6; one new token at 7; two probes standing in at 3 and 6
    keys = torch.tensor([0, 2, 3, 6, 7, 3, 6])
    queries = torch.tensor([7, 3, 6])
    seen = (visibility_mask(queries, keys, torch.float16, probes=2)[0, 0] == 0).tolist()
    assert seen == [[True, True, True, True, True, False, False],   # the real token: no scratch row
                    [True, True, False, False, False, True, False],  # probe at 3: rows at 0, 2 and itself
                    [True, True, True, False, False, False, True]]   # probe at 6: rows at 0, 2, 3 and itself


def test_fresh_layer0_kv_is_what_a_plain_prefill_stores_at_any_positions(tiny, layer0_oracle):
    ids = [tiny.bos_id] + tiny.encode("positions with gaps")
    positions = [0, 1, 2, 5, 6, 10, 11, 12, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51][:len(ids)]
    keys, values = fresh_layer0_kv(tiny, ids, positions)
    want_keys, want_values = layer0_oracle(tiny, ids, positions)
    assert keys.shape == want_keys.shape == (1, tiny.num_kv_heads, len(ids), tiny.head_dim)
    torch.testing.assert_close(keys, want_keys, rtol=0, atol=1e-5)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-5)


def test_a_chunked_prefill_predicts_what_one_plain_forward_does(tiny, fresh_logits, monkeypatch):
    import positronic.state.forward as forward_module

    monkeypatch.setattr(forward_module, "PREFILL_CHUNK", 7)  # 20 tokens in three chunks
    ids = [tiny.bos_id] + list(range(40, 59))
    positions = [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    cache = SpliceCache(tiny.model.config, max_cache_len=32)
    result = prefill(tiny, cache, ids, positions, attention_layers=[0, 1])
    plain = fresh_logits(tiny, ids, positions)
    assert result.predicted.tolist() == plain.argmax(-1).tolist()
    torch.testing.assert_close(result.logits, plain[-1], rtol=0, atol=1e-4)
    assert result.attention.shape == (2, tiny.num_heads, 20) and cache.length == 20
    torch.testing.assert_close(result.attention.sum(-1), torch.ones(2, tiny.num_heads))
    with pytest.raises(ValueError, match="prefill starts from an empty cache"):
        prefill(tiny, cache, ids, positions)


def test_forward_refuses_tokens_without_positions_and_an_attention_row_of_an_older_row(tiny):
    cache = SpliceCache(tiny.model.config, max_cache_len=16)
    with pytest.raises(ValueError, match="one position per token"):
        forward(tiny, cache, [1, 2], [0], [0])
    with pytest.raises(ValueError, match="at least one token"):
        forward(tiny, cache, [], [], [])
    with pytest.raises(ValueError, match="the newest row only"):
        forward(tiny, cache, [5], [1], [0, 1, 2], attention_layers=[0])
    assert cache.length == 0, "nothing was written"


@pytest.mark.parametrize("feed", [[42], [40, 41, 42]])
def test_without_the_weights_the_query_and_normaliser_come_from_the_kernel_and_no_key_is_read_again(
        smol, monkeypatch, feed):
    """`weights=False` (a per-layer policy, which reads no shared attention row): the same
    scaled query and, within float error, the same log-normaliser as the row computed from the
    keys, and the keys are not read again for it; the logits do not change."""
    prompt = [smol.bos_id] + smol.encode(PROMPT)
    layers = list(range(smol.num_layers))
    caches = []
    for _ in range(2):
        cache = SpliceCache(smol.model.config, max_cache_len=64)
        prefill(smol, cache, prompt, list(range(len(prompt))))
        caches.append(cache)
    positions = list(range(len(prompt), len(prompt) + len(feed)))
    keys = list(range(len(prompt))) + positions
    full = forward(smol, caches[0], feed, positions, keys, attention_layers=layers)

    def no_keys(*args):
        raise AssertionError("the keys were read again")

    monkeypatch.setattr(SpliceCache, "layer_keys", no_keys)
    light = forward(smol, caches[1], feed, positions, keys, attention_layers=layers, weights=False)
    assert light.attention is None and full.attention is not None
    assert torch.equal(light.logits, full.logits)
    assert torch.equal(light.query, full.query)
    torch.testing.assert_close(light.log_norm, full.log_norm, rtol=0, atol=2e-5)
