"""SpliceCache: a transformers Cache for the model, row edits for the brain.

The reference for every edit is the plain `torch.cat` / indexing semantics, written here as
the oracle (the only place they survive).
"""

import random

import pytest
import torch

from positronic import SpliceCache
from positronic.kv import rope
from positronic.kv.cache import SpliceLayer
from positronic.models import with_cache

KV_HEADS, HEAD_DIM = 2, 8


def rows(count, start=0):
    """Recognisable K/V rows [1, kv_heads, count, head_dim]: row r holds the value r + start."""
    values = torch.arange(start, start + count, dtype=torch.float32)
    return values[None, None, :, None].expand(1, KV_HEADS, count, HEAD_DIM).clone()


def filled(count, capacity, layers=2):
    cache = SpliceCache(num_layers=layers, max_cache_len=capacity)
    for index in range(layers):
        cache.update(rows(count), -rows(count), index)
    return cache


def layout_oracle(old: torch.Tensor, kept, length):
    """What a splice must leave: kept runs at their new rows; gaps are unspecified (NaN)."""
    new = torch.full((1, KV_HEADS, length, HEAD_DIM), float("nan"))
    for o, n, c in kept:
        new[:, :, n : n + c] = old[:, :, o : o + c]
    return new


def random_kept(rng, length):
    """Random deletions and insertions over `length` rows, as runs (old, new, count)."""
    kept, new_row, run = [], 0, None
    for old_row in range(length):
        new_row += rng.choice([0, 0, 0, 1, 2])  # inserted rows before this one
        if rng.random() < 0.15:  # deleted
            run = None
            continue
        if run and run[0] + run[2] == old_row and run[1] + run[2] == new_row:
            run[2] += 1
        else:
            run = [old_row, new_row, 1]
            kept.append(run)
        new_row += 1
    new_row += rng.choice([0, 1, 3])  # appended rows
    return [tuple(r) for r in kept], new_row


def test_generate_with_splice_cache_gives_the_same_greedy_tokens(tiny, smol):
    for lm in (tiny, smol):
        ids = torch.tensor([[lm.bos_id] + lm.encode("The lighthouse keeper counted the stairs")])
        plain = lm.model.generate(ids, max_new_tokens=24, do_sample=False)
        cache = SpliceCache(lm.model.config, max_cache_len=16)  # too small on purpose: it grows
        spliced = lm.model.generate(ids, max_new_tokens=24, do_sample=False, **with_cache(cache))
        assert torch.equal(plain, spliced)
        assert cache.length == plain.shape[1] - 1 and cache.layers[0].capacity >= cache.length


@pytest.mark.parametrize("seed", range(12))
def test_splice_moves_rows_exactly_like_the_oracle(seed):
    rng = random.Random(seed)
    cache = filled(30, capacity=48)
    for _ in range(25):
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        kept, length = random_kept(rng, cache.length)
        cache.splice(kept, length)
        for layer, (keys, values) in zip(cache.layers, before):
            for got, old in ((layer.keys, keys), (layer.values, values)):
                want = layout_oracle(old, kept, length)
                known = ~want.isnan()
                assert got.shape == want.shape
                assert torch.equal(got[known], want[known])
        if cache.length > 60:  # keep it bounded: drop the tail
            cache.splice([(0, 0, 40)], 40)
    assert cache.layers[0].capacity >= 48


def runs_keeping(kept_rows: list[int]) -> list[tuple[int, int, int]]:
    """Runs (old, new, count) that keep `kept_rows` (ascending) and close the gaps."""
    runs = []
    for new, old in enumerate(kept_rows):
        if runs and runs[-1][0] + runs[-1][2] == old:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((old, new, 1))
    return runs


@pytest.mark.parametrize("seed", range(6))
def test_per_head_splices_keep_each_heads_rows_like_the_oracle(seed):
    """Lanes (layer x kv head): every head drops its own rows, the same number, then rows are
    appended; each head's rows must be its kept rows in order, through anchor moves and growth."""
    rng = random.Random(seed)
    cache = filled(30, capacity=48)
    for _ in range(30):
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        drop, add = rng.choice([0, 1, 1, 2, 4]), rng.choice([0, 1, 1, 3, 9])
        kept_rows = [sorted(rng.sample(range(cache.length), cache.length - drop)) for _ in range(2 * KV_HEADS)]
        length = cache.length - drop + add
        cache.splice_layers([runs_keeping(rows_of) for rows_of in kept_rows], length)
        for index, (layer, (keys, values)) in enumerate(zip(cache.layers, before)):
            assert layer.keys.shape[2] == length
            for head in range(KV_HEADS):  # bit for bit: appended rows were never written (any bits, NaN too)
                rows_of = torch.tensor(kept_rows[index * KV_HEADS + head])
                kept = len(rows_of)
                for got, old in ((layer.keys, keys), (layer.values, values)):
                    assert torch.equal(got[:, head, :kept].view(torch.int32), old[:, head, rows_of].view(torch.int32))
    assert cache.layers[0].capacity > 48, "the rows outgrew the buffer once"
    front = filled(200, capacity=400, layers=1)
    untouched = front.layers[0].key_buffer[:, :, 10:200].clone()
    front.splice_layers([runs_keeping([r for r in range(200) if r != drop]) for drop in (3, 7)], 199)
    assert front.layers[0].start == 1, "each head moved the rows before its drop, not the 190 after"
    assert torch.equal(front.layers[0].key_buffer[:, :, 10:200], untouched)



@pytest.mark.parametrize("seed", range(3))
def test_per_layer_splices_keep_each_layers_rows_and_move_them_all_in_one_slab(seed):
    """Lanes that are whole layers (gates trained without --per-head): each layer drops its own
    rows, every head of it alike, bit for bit like the oracle; and the rows move in the Slab the
    layers share, as per-head lanes' do, so their keys are read back as one view."""
    rng = random.Random(seed)
    cache = filled(30, capacity=48, layers=3)
    for _ in range(20):
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        drop, add = rng.choice([0, 1, 1, 2, 4]), rng.choice([0, 1, 1, 3, 9])
        kept_rows = [sorted(rng.sample(range(cache.length), cache.length - drop)) for _ in cache.layers]
        length = cache.length - drop + add
        cache.splice_layers([runs_keeping(rows_of) for rows_of in kept_rows], length)
        for layer, (keys, values), rows_of in zip(cache.layers, before, kept_rows):
            assert layer.keys.shape[2] == length
            at = torch.tensor(rows_of)
            for got, old in ((layer.keys, keys), (layer.values, values)):
                assert torch.equal(got[:, :, : len(at)].view(torch.int32), old[:, :, at].view(torch.int32))
    slab = cache.layers[0].slab
    assert slab is not None and slab.holds(cache.layers), "the layers' rows moved in one slab, not layer by layer"
    keys = cache.layer_keys([0, 1, 2], 10)  # every layer's keys: a view of the slab, no copy
    assert keys.untyped_storage().data_ptr() == slab.keys.untyped_storage().data_ptr()

def assert_lane_rows_read_each_heads_own_rows(cache):
    """`lane_rows`: per lane (layer x kv head) its own rows, and per layer the same rows in every head."""
    per_head = [[(3 * lane + 1) % 30, lane % 7, 29] for lane in range(len(cache.layers) * KV_HEADS)]
    per_layer = [[layer % 5, 12] for layer in range(len(cache.layers))]
    same = [[4, 9, 2]] * len(cache.layers)  # shared rows: the same in every layer
    for rows_of, heads in ((per_head, KV_HEADS), (per_layer, 1), (same, 1)):
        keys, values = cache.lane_rows(rows_of)
        for index, layer in enumerate(cache.layers):
            for head in range(KV_HEADS):
                at = torch.tensor(rows_of[index * heads + (head if heads > 1 else 0)])
                assert torch.equal(keys[index, head].view(torch.int32), layer.keys[0, head, at].view(torch.int32))
                assert torch.equal(values[index, head].view(torch.int32), layer.values[0, head, at].view(torch.int32))


def test_lane_rows_read_each_heads_own_rows_before_any_slab():
    cache = filled(40, capacity=64, layers=3)
    for index, layer in enumerate(cache.layers):  # every (layer, head) holds values of its own
        layer.key_buffer[:, 1] += 500
        layer.key_buffer += 1000 * index
        layer.value_buffer[:, 1] -= 500
    assert_lane_rows_read_each_heads_own_rows(cache)


def test_per_head_splices_move_every_layers_rows_in_one_slab_even_after_a_layer_grew_alone():
    """The lanes' rows move in one Slab shared by all layers (views of one tensor); a layer that
    grew a buffer of its own since is taken back in with its rows, and the others keep theirs."""
    cache = filled(40, capacity=64, layers=3)
    cache.layers[0].key_buffer[:, :, :40] += 1000  # layer 0's rows differ from the others'
    drops = [5, 9, 30]

    def splice_and_check():
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        kept_rows = [[r for r in range(cache.length) if r != drops[lane % 3]] for lane in range(3 * KV_HEADS)]
        cache.splice_layers([runs_keeping(rows_of) for rows_of in kept_rows], cache.length)  # a gap at the end
        storage = {layer.key_buffer.untyped_storage().data_ptr() for layer in cache.layers}
        assert len(storage) == 1, "every layer's keys are a view of one slab"
        stacked = cache.layer_keys([0, 1, 2], cache.length - 1)
        assert stacked.untyped_storage().data_ptr() in storage, "all layers' keys read without a copy"
        assert torch.equal(stacked.view(torch.int32),
                           torch.stack([layer.keys[0, :, :-1] for layer in cache.layers]).view(torch.int32))
        assert torch.equal(cache.layer_keys([2], 5), cache.layers[2].keys[:, :, :5])
        assert_lane_rows_read_each_heads_own_rows(cache)
        for index, (layer, (keys, values)) in enumerate(zip(cache.layers, before)):
            for head in range(KV_HEADS):  # bit for bit: the gap row left last time holds any bits, NaN too
                rows_of = torch.tensor(kept_rows[index * KV_HEADS + head])
                for got, old in ((layer.keys, keys), (layer.values, values)):
                    assert torch.equal(got[:, head, : len(rows_of)].view(torch.int32), old[:, head, rows_of].view(torch.int32))

    splice_and_check()
    cache.layers[1].reserve(100)  # layer 1 alone outgrows the slab: a buffer of its own
    assert cache.layers[1].capacity > 64
    assert cache.layers[1].key_buffer.untyped_storage().data_ptr() != cache.layers[0].key_buffer.untyped_storage().data_ptr()
    splice_and_check()
    assert all(layer.capacity == cache.layers[1].capacity for layer in cache.layers)


def test_per_head_splices_tick_after_tick_move_few_rows_once_the_buffer_end_is_reached():
    """Each tick every head drops a row near the front and one row is appended: the rows before
    each drop move up one and creep towards the buffer's end. Reaching it, they are packed down
    once, not anchored in place (which would move nearly every row on every tick after)."""
    cache = filled(200, capacity=260, layers=1)
    layer, moved = cache.layers[0], []
    for _ in range(200):
        kept = [runs_keeping([r for r in range(200) if r != drop]) for drop in (3, 7)]
        moved.append(int(SpliceLayer.lane_moves(cache.layers, kept, 200)[1][3].sum()))
        cache.splice_layers(kept, 200)  # row 199: the gap the tick's new token fills
    packs = sum(m > 20 for m in moved)
    assert packs <= 4, f"{packs} ticks moved more than 20 rows: {moved}"
    assert sum(moved) < 200 * 10 + 4 * 400


def test_an_edit_near_the_front_moves_only_the_front_rows():
    cache = filled(200, capacity=400, layers=1)
    layer = cache.layers[0]
    buffer_before = layer.key_buffer.clone()
    cache.splice([(0, 0, 3), (4, 3, 196)], 199)  # delete row 3
    assert layer.start == 1, "rows 0..2 moved right by one; the start follows them"
    assert torch.equal(layer.key_buffer[:, :, 4:200], buffer_before[:, :, 4:200]), "rows 4.. did not move"
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2] + list(range(4, 200))
    cache.splice([(0, 0, 195), (196, 195, 3)], 198)  # delete the 4th row from the end
    assert layer.start == 1 and layer.keys[0, 0, -4:, 0].tolist() == [195, 197, 198, 199]


def test_steady_state_edits_never_allocate_and_memory_is_exact():
    cache = filled(100, capacity=160)
    buffers = [(layer.key_buffer, layer.value_buffer) for layer in cache.layers]
    row_bytes = 2 * KV_HEADS * HEAD_DIM * 4
    for _ in range(200):  # a tick: replace a pair near the front by one token, append one
        cache.splice([(0, 0, 10), (12, 11, 88)], 99)
        with cache.fill(torch.tensor([10])):
            for index in range(2):
                cache.update(rows(1, 1000), -rows(1, 1000), index)
        for index in range(2):
            cache.update(rows(1, 2000), -rows(1, 2000), index)
        assert cache.length == 100 and cache.layers[1].keys[0, 0, 10, 0] == 1000
    assert all(layer.key_buffer is k and layer.value_buffer is v for layer, (k, v) in zip(cache.layers, buffers))
    scratch = cache.scratch.memory_bytes()
    assert scratch <= 100 * KV_HEADS * HEAD_DIM * 4, "the scratch holds at most one run of one layer"
    assert cache.memory_bytes() == 2 * 160 * row_bytes + scratch
    cache.reset()
    assert cache.length == 0 and cache.layers[0].key_buffer is buffers[0][0]


def test_fill_writes_into_the_named_rows_only():
    cache = filled(10, capacity=16, layers=1)
    cache.splice([(0, 0, 4), (4, 6, 6)], 12)  # gaps at rows 4 and 5
    with cache.fill(torch.tensor([4, 5])):
        cache.update(rows(2, 100), -rows(2, 100), 0)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 100, 101, 4, 5, 6, 7, 8, 9]
    assert cache.layers[0]._write_rows is None, "fill ends with its block"


def test_rotate_keys_matches_rope_on_the_rows_asked():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    cache = SpliceCache(num_layers=1, max_cache_len=16)
    keys = torch.randn(1, KV_HEADS, 8, HEAD_DIM)
    cache.update(keys, keys.clone(), 0)
    cos, sin = rope.rotation(inv_freq, torch.arange(3, 8), torch.arange(5, 10))
    cache.rotate_keys(3, cos, sin)
    torch.testing.assert_close(cache.layers[0].keys[:, :, 3:], rope.rotate(keys[:, :, 3:], cos, sin))
    assert torch.equal(cache.layers[0].keys[:, :, :3], keys[:, :, :3])
    assert torch.equal(cache.layers[0].values, keys), "values are never rotated"


def test_bad_rows_are_refused_and_change_nothing():
    cache = filled(4, capacity=8, layers=1)
    before = cache.layers[0].keys.clone()
    with pytest.raises(ValueError, match=r"new keys have shape \[1, 2, 2, 9\]; this cache takes \[1, 2, n, 8\]"):
        cache.update(torch.zeros(1, KV_HEADS, 2, HEAD_DIM + 1), torch.zeros(1, KV_HEADS, 2, HEAD_DIM + 1), 0)
    with pytest.raises(ValueError, match="2 new key rows but 3 value rows"):
        cache.update(torch.zeros(1, KV_HEADS, 2, HEAD_DIM), torch.zeros(1, KV_HEADS, 3, HEAD_DIM), 0)
    with pytest.raises(ValueError, match="float64"):
        cache.update(torch.zeros(1, KV_HEADS, 2, HEAD_DIM, dtype=torch.float64),
                     torch.zeros(1, KV_HEADS, 2, HEAD_DIM, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="one sequence"):
        SpliceLayer(4).update(torch.zeros(2, KV_HEADS, 1, HEAD_DIM), torch.zeros(2, KV_HEADS, 1, HEAD_DIM))
    assert torch.equal(cache.layers[0].keys, before) and cache.length == 4


def test_construction_errors_are_clear():
    with pytest.raises(ValueError, match="needs a model config or num_layers"):
        SpliceCache()
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        SpliceCache(num_layers=2, max_cache_len=0)


@pytest.mark.parametrize("kv_format, store", [("float", "splice"), ("float", "ring"), ("int4", "splice"),
                                              ("fp4", "splice"), ("int4h", "splice")])
def test_each_layer_type_saves_its_rows_and_loads_them_back_as_they_were(tiny, kv_format, store):
    """A session's tensors come from the layer type (`saved_parts`, `saved`) and go back into
    an empty cache of the same type (`load`): the same tensors again, the same rows read."""
    config, heads, head_dim = tiny.model.config, tiny.num_kv_heads, tiny.head_dim

    def cache():
        made = SpliceCache(config, max_cache_len=12, kv_format=kv_format, store=store, sinks=2)
        made.set_positions(range(30))
        return made

    old = cache()
    keys, values = torch.randn(1, heads, 20, head_dim), torch.randn(1, heads, 20, head_dim)
    for index in range(len(old.layers)):
        old.update(keys, values, index)
    old.splice([(0, 0, 2), (7, 2, 13)], 15)  # a ring's cursor moves: rows saved in row order go back to its slots
    old.set_positions(list(range(2)) + list(range(7, 20)))
    saved = old.saved(heads, head_dim, torch.float32)
    parts = old.saved_parts(heads, head_dim, torch.float32)
    assert set(saved) == set(parts)
    for name, (shape, dtype) in parts.items():
        assert tuple(saved[name].shape) == shape[:2] + (15,) + shape[2:] and saved[name].dtype == dtype
    old.check_saved(saved)
    new = cache()
    if store == "ring":
        new.set_ring(old.ring)
    else:
        new.set_positions(list(range(2)) + list(range(7, 20)))
    new.load(saved, torch.float32, "cpu")
    again = new.saved(heads, head_dim, torch.float32)
    assert all(torch.equal(saved[name], again[name]) for name in saved)
    for a, b in zip(old.layers, new.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    if kv_format == "int4h":
        bad = dict(saved, key_zeros=saved["key_zeros"].clone().fill_(16))
        with pytest.raises(ValueError, match="zero points"):
            old.check_saved(bad)
