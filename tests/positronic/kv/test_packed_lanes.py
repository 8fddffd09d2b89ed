"""Lanes that keep rows of their own (SmartKV: each kv head of each layer) in the 4-bit formats:
a per-lane splice moves each lane's codes and scales exactly as the float cache moves its rows,
a row taken back into some lanes is encoded there alone, and int4h reads every lane's keys at
its own rows' positions."""

import random

import pytest
import torch

from positronic import SpliceCache
from positronic.kv import rope
from positronic.kv.centres import key_centres
from positronic.kv.formats import PACKED, ROW_SCALED, Int4H, bytes_per_token

from .test_cache import runs_keeping
from .test_formats import quantized, random_rows

KV_HEADS, HEAD_DIM, LAYERS = 2, 16, 2


def written(cache, rows: int, seed: int = 0, heads: int = KV_HEADS, dim: int = HEAD_DIM):
    """`rows` random rows [1, heads, rows, dim] appended to every layer; returns them per
    layer: [(keys, values)]."""
    out = []
    for layer in range(len(cache.layers)):
        keys = random_rows(rows, heads=heads, dim=dim, seed=seed + 2 * layer)
        values = random_rows(rows, heads=heads, dim=dim, seed=seed + 2 * layer + 1)
        cache.update(keys, values, layer)
        out.append((keys, values))
    return out


def random_lanes(rng, length: int, lanes: int, drop: int) -> list[list[int]]:
    """Each lane's kept rows: all but `drop` of its own."""
    return [sorted(rng.sample(range(length), length - drop)) for _ in range(lanes)]


@pytest.mark.parametrize("name", sorted(ROW_SCALED))
@pytest.mark.parametrize("seed", range(3))
def test_per_head_splices_move_each_lanes_codes_like_the_float_cache_moves_its_rows(name, seed):
    """Every kv head drops rows of its own, tick after tick, through the buffer's end and its
    growth: each lane then holds its kept rows as the float cache does, quantized, bit for bit."""
    rng, codec = random.Random(seed), PACKED[name]
    packed = SpliceCache(num_layers=LAYERS, max_cache_len=40, kv_format=name)
    reference = SpliceCache(num_layers=LAYERS, max_cache_len=40)
    for layer, (keys, values) in enumerate(written(packed, 30, seed)):
        reference.update(keys, values, layer)
    for tick in range(25):
        drop, add = rng.choice([1, 1, 2]), rng.choice([0, 1, 1, 4])
        kept = random_lanes(rng, packed.length, LAYERS * KV_HEADS, drop)
        length = packed.length - drop + add
        for cache in (packed, reference):
            cache.splice_layers([runs_keeping(rows) for rows in kept], length)
        if add:  # the new rows, written after each lane's kept ones
            gaps = torch.arange(length - add, length)
            for layer in range(LAYERS):
                keys, values = random_rows(add, seed=1000 + 2 * (tick * LAYERS + layer)), \
                    random_rows(add, seed=1001 + 2 * (tick * LAYERS + layer))
                for cache in (packed, reference):
                    with cache.fill(gaps):
                        cache.update(keys, values, layer)
        else:
            for cache in (packed, reference):
                cache.splice_layers([[(0, 0, length)]] * (LAYERS * KV_HEADS), length)
        for got, want in zip(packed.layers, reference.layers):
            assert got.length == want.length == length
            assert torch.equal(got.keys, quantized(codec, want.keys))
            assert torch.equal(got.values, quantized(codec, want.values))
    assert packed.layers[0].capacity > 40, "it grew"


@pytest.mark.parametrize("name", sorted(ROW_SCALED))
def test_a_row_taken_back_into_some_lanes_is_encoded_there_alone(name):
    codec = PACKED[name]
    cache = SpliceCache(num_layers=LAYERS, max_cache_len=16, kv_format=name)
    written(cache, 8)
    cache.splice_layers([runs_keeping(list(range(8)))] * (LAYERS * KV_HEADS), 8)  # lanes: one slab per part
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    keys, values = random_rows(2, heads=1, seed=50)[0, 0], random_rows(2, heads=1, seed=51)[0, 0]  # [2, head_dim]
    cache.put_lane_rows([1, 2], [3, 5], keys, values)  # layer 0 head 1 row 3; layer 1 head 0 row 5
    for (layer, head, row, k) in ((0, 1, 3, 0), (1, 0, 5, 1)):
        got = cache.layers[layer]
        assert torch.equal(got.keys[0, head, row], quantized(codec, keys[k]))
        assert torch.equal(got.values[0, head, row], quantized(codec, values[k]))
        before[layer][0][0, head, row] = got.keys[0, head, row]
        before[layer][1][0, head, row] = got.values[0, head, row]
    for got, (keys_before, values_before) in zip(cache.layers, before):  # no other row changed
        assert torch.equal(got.keys, keys_before) and torch.equal(got.values, values_before)


def int4h_cache(tiny, rows: int, seed: int, positions: torch.Tensor) -> SpliceCache:
    """An int4h cache of the tiny model's shape holding `rows` random rows at `positions`."""
    cache = SpliceCache(tiny.model.config, max_cache_len=64, kv_format="int4h", key_centres=key_centres(tiny))
    cache.set_positions(positions)
    written(cache, rows, seed, tiny.num_kv_heads, tiny.head_dim)
    return cache


def test_int4h_lanes_read_each_key_at_its_own_lanes_position(tiny):
    """After a per-lane splice every lane's keys are read at the positions set for that lane:
    the kept rows read exactly as before. Until they are set, reading is refused; read at
    the union's positions instead, the keys are wrong."""
    cache = int4h_cache(tiny, 20, 7, torch.arange(100, 120))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    lanes = tiny.num_layers * tiny.num_kv_heads
    kept = random_lanes(random.Random(3), 20, lanes, 5)
    cache.splice_layers([runs_keeping(rows) for rows in kept], 15)
    with pytest.raises(ValueError, match="needs their positions"):
        cache.layers[0].keys
    cache.set_lane_positions([[100 + row for row in rows] for rows in kept])
    for index, (layer, (keys, values)) in enumerate(zip(cache.layers, before)):
        for head in range(tiny.num_kv_heads):
            rows = torch.tensor(kept[index * tiny.num_kv_heads + head])
            assert torch.equal(layer.keys[0, head], keys[0, head, rows]), (index, head)
            assert torch.equal(layer.values[0, head], values[0, head, rows])
    cache.set_positions(torch.arange(100, 115))  # the rows are not those positions' any more
    assert not torch.allclose(cache.layers[1].keys, before[1][0][:, :, :15], atol=1e-3)
    with pytest.raises(ValueError, match="lane positions are"):
        cache.set_lane_positions([[100] * 15] * (lanes + 1))


def test_int4h_a_key_taken_back_is_stored_before_rope_from_the_position_it_was_rotated_at(tiny):
    """A recalled key comes rotated at the position its token held: stored un-rotated from
    there, it reads back (within the format's bound) at whatever position its row holds."""
    cache = int4h_cache(tiny, 10, 9, torch.arange(10))
    lanes = tiny.num_layers * tiny.num_kv_heads
    cache.splice_layers([runs_keeping(list(range(10)))] * lanes, 10)
    lane_positions = [[40 + row for row in range(10)] for _ in range(lanes)]
    cache.set_lane_positions(lane_positions)
    plain = random_rows(1, heads=1, dim=tiny.head_dim, seed=60)[0, 0]  # [1, head_dim], at position 0
    values = random_rows(1, heads=1, dim=tiny.head_dim, seed=61)[0, 0]
    at = 25
    cos, sin = rope.rotation(tiny.inv_freq, torch.tensor([0]), torch.tensor([at]))
    cache.put_lane_rows([1], [4], rope.rotate(plain, cos, sin), values, positions=[at])  # layer 0, head 1, row 4
    layer = cache.layers[0]
    cos, sin = rope.rotation(tiny.inv_freq, torch.tensor([0]), torch.tensor([44]))  # the row's position
    want = rope.rotate(plain, cos, sin)
    bound = Int4H().error_bound(layer.coded_keys(want[None, None], torch.tensor([44]), head=1))
    assert bool(((layer.keys[0, 1, 4] - want[0]).abs() <= bound[0, 0, 0] + 1e-5).all())
    assert not torch.allclose(layer.keys[0, 1, 4], rope.rotate(plain, *rope.rotation(
        tiny.inv_freq, torch.tensor([0]), torch.tensor([at])))[0], atol=1e-2), "read at the row's position, not 25"
    again = int4h_cache(tiny, 10, 9, torch.arange(10))  # the rows' own positions (None): the key given at 44
    again.splice_layers([runs_keeping(list(range(10)))] * lanes, 10)
    again.set_lane_positions(lane_positions)
    again.put_lane_rows([1], [4], want, values)
    torch.testing.assert_close(again.layers[0].keys[0, 1, 4], layer.keys[0, 1, 4], atol=1e-5, rtol=1e-5)


def test_int4h_lane_positions_take_four_bytes_per_lane_and_token(tiny):
    """Per-lane rows keep each lane's positions (int32) instead of one per row for all layers:
    what `memory_bytes` counts and `bytes_per_token` says a token costs with lanes."""
    cache = int4h_cache(tiny, 12, 3, torch.arange(12))
    shared = cache.memory_bytes()
    lanes = tiny.num_layers * tiny.num_kv_heads
    cache.splice_layers([runs_keeping(list(range(12)))] * lanes, 12)
    cache.set_lane_positions([list(range(12))] * lanes)
    assert cache.memory_bytes() - shared == 4 * lanes * 12 - 8 * 12
    shape = dict(layers=tiny.num_layers, kv_heads=tiny.num_kv_heads, head_dim=tiny.head_dim, dtype=torch.float32)
    assert bytes_per_token("int4h", lanes=lanes, **shape) - bytes_per_token("int4h", **shape) == 4 * lanes - 8
    cache.set_lane_positions([list(range(12))] * tiny.num_layers)  # a lane per layer: once for its kv heads
    assert cache.memory_bytes() - shared == 4 * tiny.num_layers * 12 - 8 * 12


@pytest.mark.parametrize("name", [*sorted(ROW_SCALED), "int4h"])
@pytest.mark.parametrize("lanes_kind", ["shared rows", "per head"])
def test_lane_rows_decode_only_the_rows_read_and_match_the_whole_decode(tiny, name, lanes_kind):
    """`lane_rows` (what recall stores of a token leaving the window) gathers and decodes the
    rows it reads: the same values as decoding every live row and picking them."""
    cache = SpliceCache(tiny.model.config, max_cache_len=64, kv_format=name,
                        key_centres=key_centres(tiny) if name == "int4h" else None)
    cache.set_positions(torch.arange(30, 50))
    written(cache, 20, 11, tiny.num_kv_heads, tiny.head_dim)
    lanes = tiny.num_layers * tiny.num_kv_heads
    if lanes_kind == "per head":
        kept = random_lanes(random.Random(5), 20, lanes, 4)
        cache.splice_layers([runs_keeping(rows) for rows in kept], 16)
        cache.set_lane_positions([[30 + row for row in rows] for rows in kept])
        read = [[(3 * lane + 1) % 16, lane % 5, 15] for lane in range(lanes)]
    else:
        read = [[4, 9, 2]] * tiny.num_layers
    keys, values = cache.lane_rows(read)
    heads = len(read) // tiny.num_layers
    for index, layer in enumerate(cache.layers):
        for head in range(tiny.num_kv_heads):
            at = torch.tensor(read[index * heads + (head if heads > 1 else 0)])
            torch.testing.assert_close(keys[index, head], layer.keys[0, head, at], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(values[index, head], layer.values[0, head, at], atol=1e-6, rtol=1e-6)
