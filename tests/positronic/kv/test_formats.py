"""4-bit KV storage: the INT4 and FP4 codecs, the packed cache layer, and the
brain running on them; then the same for int4h (section 5).

Reference for every packed-cache edit: the float cache doing the same edits, its rows
quantized independently (row by row, so moving a row must move exactly its codes and scale).
"""

import contextlib
import copy
import math
import random

import pytest
import torch

from positronic import SpliceCache, StateManager

from positronic.kv import rope
from positronic.brain import session as sessions
from positronic.evaluate import evaluate
from positronic.kv.centres import key_centres
from positronic.kv.formats import (FP4, PACKED, ROW_SCALED, Int4, Int4H, _lookup_nibbles, byte_table, bytes_per_token,
                                   hadamard, lookup, pack, unpack)
from positronic.brain.loop import Brain, BrainConfig
from positronic.state import FAULT_STAGES, StateInvariantError, rounding_bounds
from positronic.models import with_cache

FORMATS = sorted(ROW_SCALED)  # one scale per row; int4h has its own tests (section 5)
KV_HEADS, HEAD_DIM = 2, 16
EPS = 1e-6  # float32 arithmetic in x / scale


def random_rows(count, *, heads=KV_HEADS, dim=HEAD_DIM, seed=0):
    """[1, heads, count, dim] float32 rows with magnitudes spread over four decades."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10 ** torch.empty(1, heads, count, 1).uniform_(-2, 2, generator=g)
    return torch.randn(1, heads, count, dim, generator=g) * magnitude


# --- 1. the codecs --------------------------------------------------------------------------


def test_pack_puts_code_j_in_bits_4j_and_unpack_inverts_it():
    nibbles = torch.randint(0, 16, (3, 5, 64), dtype=torch.int32)
    codes = pack(nibbles)
    assert codes.shape == (3, 5, 8) and codes.dtype == torch.int32
    assert torch.equal(unpack(codes), nibbles)
    one = torch.zeros(8, dtype=torch.int32)
    one[7] = 15  # the top nibble lands in the sign bit
    assert pack(one).item() == -(1 << 28) and pack(torch.arange(8, dtype=torch.int32)).item() == 0x76543210


def test_lookup_reads_two_codes_per_byte_as_unpacking_would():
    """The byte-table decode against nibble by nibble, on a strided view as a cache holds
    it, and the big-endian path."""
    levels = torch.randn(16)
    codes = pack(torch.randint(0, 16, (2, 3, 40, 64), dtype=torch.int32))[:, :, 5:29]
    want = levels[unpack(codes).long()]
    table = byte_table(levels)
    assert torch.equal(lookup(codes, table), want)
    assert torch.equal(_lookup_nibbles(codes, table), want)


@pytest.mark.parametrize("name", FORMATS)
def test_encode_shapes_dtypes_and_head_dim_check(name):
    codec = PACKED[name]
    codes, scales = codec.encode(random_rows(7))
    assert codes.shape == (1, KV_HEADS, 7, HEAD_DIM // 8) and codes.dtype == torch.int32
    assert scales.shape == (1, KV_HEADS, 7) and scales.dtype == torch.float16
    assert codec.decode(codes, scales).shape == (1, KV_HEADS, 7, HEAD_DIM)
    with pytest.raises(ValueError, match="head_dim 12 is not a multiple of 8"):
        codec.encode(torch.zeros(1, 1, 1, 12))


@pytest.mark.parametrize("name", FORMATS)
def test_zero_rows_encode_and_decode_to_zero_rows(name):
    codec = PACKED[name]
    codes, scales = codec.encode(torch.zeros(1, KV_HEADS, 0, HEAD_DIM))
    assert codes.shape == (1, KV_HEADS, 0, HEAD_DIM // 8) and scales.shape == (1, KV_HEADS, 0)
    assert codec.decode(codes, scales).shape == (1, KV_HEADS, 0, HEAD_DIM)


def test_int4_round_trip_error_is_at_most_half_a_scale():
    codec = Int4()
    x = random_rows(500)
    codes, scales = codec.encode(x)
    s = scales.float().unsqueeze(-1)
    error = (codec.decode(codes, scales) - x).abs()
    assert bool((error <= s / 2 * (1 + EPS)).all()), float((error / s).max())
    assert float((error / s).max()) > 0.45, "the bound is tight"
    assert torch.equal(scales, (x.abs().amax(-1) / 7).half()), "scale = max|row| / 7, in float16"
    levels = codec.levels[unpack(codes)]
    assert levels.min() >= -7 and levels.max() <= 7, "symmetric: -8 is never used"


def test_fp4_gives_the_nearest_representable_value():
    codec = FP4()
    x = random_rows(500)
    codes, scales = codec.encode(x)
    decoded = codec.decode(codes, scales)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6])
    s = scales.float().unsqueeze(-1)
    nearest = (x.unsqueeze(-1) - grid * s.unsqueeze(-1)).abs().min(dim=-1).values
    error = (decoded - x).abs()
    assert bool((error <= nearest + EPS * s).all())
    assert bool((error <= s * (1 + EPS)).all()), "at most one scale: half the widest gap (4 .. 6)"
    assert torch.equal(scales, (x.abs().amax(-1) / 6).half())
    assert set(codec.levels[unpack(codes)].unique().tolist()) <= set(grid.tolist())


@pytest.mark.parametrize("name", FORMATS)
def test_values_on_the_grid_round_trip_exactly_and_codes_are_canonical(name):
    codec = PACKED[name]
    g = torch.Generator().manual_seed(1)
    count = 300
    grid = codec.levels[codec.levels.abs() <= codec.top]  # int4: -7 .. 7 (the scale never lets -8 in)
    levels = grid[torch.randint(0, len(grid), (count, 32), generator=g)]
    levels[:, 0] = codec.top * torch.where(torch.rand(count, generator=g) < 0.5, -1.0, 1.0)  # the row's max
    scales = (10 ** torch.empty(count).uniform_(-3, 3, generator=g)).half()
    x = levels * scales.float().unsqueeze(-1)
    codes, got_scales = codec.encode(x)
    assert torch.equal(got_scales, scales)
    assert torch.equal(codec.decode(codes, got_scales), x), "exact"
    again = codec.encode(codec.decode(codes, got_scales))
    assert torch.equal(again[0], codes) and torch.equal(again[1], scales), "one code per value (no -0)"


@pytest.mark.parametrize("name", FORMATS)
def test_a_row_of_zeros_stays_zeros(name):
    codec = PACKED[name]
    codes, scales = codec.encode(torch.zeros(2, 16))
    assert torch.equal(codec.decode(codes, scales), torch.zeros(2, 16)) and bool((scales == 0).all())


def test_bytes_per_token():
    smollm2 = dict(layers=30, kv_heads=3, head_dim=64)
    assert bytes_per_token("float", dtype=torch.float32, **smollm2) == 46080
    assert bytes_per_token("float", dtype=torch.float16, **smollm2) == 23040
    assert bytes_per_token("int4", dtype=torch.float32, **smollm2) == bytes_per_token("fp4", dtype=torch.float16,
                                                                                     **smollm2) == 6120
    with pytest.raises(ValueError, match="unknown kv format 'int8'; choose from float, int4, fp4, int4h"):
        bytes_per_token("int8", dtype=torch.float32, **smollm2)


# --- 2. the packed cache against the float cache, quantized independently --------------------


def quantized(codec, rows):
    return codec.decode(*codec.encode(rows))


def random_kept(rng, length):
    """Random deletions and insertions over `length` rows, as runs (old, new, count)."""
    kept, new_row, run = [], 0, None
    for old_row in range(length):
        new_row += rng.choice([0, 0, 0, 1, 2])
        if rng.random() < 0.15:
            run = None
            continue
        if run and run[0] + run[2] == old_row and run[1] + run[2] == new_row:
            run[2] += 1
        else:
            run = [old_row, new_row, 1]
            kept.append(run)
        new_row += 1
    return [tuple(r) for r in kept], new_row + rng.choice([0, 1, 3])


def assert_aligned(packed, reference, codec):
    for got, want in zip(packed.layers, reference.layers):
        assert got.length == want.length
        assert torch.equal(got.keys, quantized(codec, want.keys))
        assert torch.equal(got.values, quantized(codec, want.values))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("seed", range(4))
def test_splice_fill_append_and_growth_move_codes_and_scales_together(name, seed):
    """Random splices, gaps filled by a fill forward, appends past the end (packing down) and
    past the capacity (growth): every live row stays the quantized float row."""
    codec, rng = PACKED[name], random.Random(seed)
    packed = SpliceCache(num_layers=2, max_cache_len=40, kv_format=name)
    reference = SpliceCache(num_layers=2, max_cache_len=40)
    serial = iter(range(10**6))

    def write(count, fill=None):
        for layer in range(2):
            keys, values = random_rows(count, seed=next(serial)), random_rows(count, seed=next(serial))
            for cache in (packed, reference):
                if fill is None:
                    cache.update(keys, values, layer)
                else:
                    with cache.fill(fill):
                        cache.update(keys, values, layer)

    write(24)
    for _ in range(30):
        before = reference.length
        kept, length = random_kept(rng, before)
        packed.splice(kept, length)
        reference.splice(kept, length)
        covered = {new + k for _, new, count in kept for k in range(count)}
        gaps = torch.tensor([row for row in range(length) if row not in covered], dtype=torch.long)
        if len(gaps):
            write(len(gaps), fill=gaps)
        write(rng.choice([1, 2, 5]))
        assert_aligned(packed, reference, codec)
        if reference.length > 70:
            packed.splice([(0, 0, 30)], 30)
            reference.splice([(0, 0, 30)], 30)
    assert packed.layers[0].capacity > 40, "it grew"
    assert packed.layers[0].codes.start == packed.layers[0].scales.start


@pytest.mark.parametrize("name", FORMATS)
def test_memory_is_exact_and_steady_state_edits_never_allocate(name):
    cache = SpliceCache(num_layers=2, max_cache_len=160, kv_format=name)
    for layer in range(2):
        cache.update(random_rows(100), random_rows(100), layer)
    buffers = [(layer.codes.key_buffer, layer.scales.value_buffer) for layer in cache.layers]
    for _ in range(50):  # a tick: replace a pair near the front by one token, append one
        cache.splice([(0, 0, 10), (12, 11, 88)], 99)
        with cache.fill(torch.tensor([10])):
            for layer in range(2):
                cache.update(random_rows(1), random_rows(1), layer)
        for layer in range(2):
            cache.update(random_rows(1), random_rows(1), layer)
        assert cache.length == 100
    assert all(layer.codes.key_buffer is k and layer.scales.value_buffer is s
               for layer, (k, s) in zip(cache.layers, buffers))
    row = KV_HEADS * (HEAD_DIM // 8 * 4 + 2)  # one (layer, K or V) row: codes + a float16 scale per head
    scratch = sum(s.memory_bytes() for s in cache.part_scratches)
    assert cache.memory_bytes() == 2 * 2 * 160 * row + scratch
    cache.reset()
    assert cache.length == 0 and cache.layers[0].codes.key_buffer is buffers[0][0]


@pytest.mark.parametrize("shape", [dict(layers=30, kv_heads=3, head_dim=64),   # SmolLM2-135M
                                   dict(layers=22, kv_heads=4, head_dim=64)])  # TinyLlama-1.1B
@pytest.mark.parametrize("name", FORMATS)
def test_a_4bit_cache_takes_at_most_0_3_of_float16(shape, name):
    """Counted from the buffers themselves: codes + scales against float16 rows, same capacity."""
    rows = 64
    sizes = {}
    for fmt, dtype in (("float", torch.float16), (name, torch.float16)):
        cache = SpliceCache(num_layers=shape["layers"], max_cache_len=rows, kv_format=fmt)
        for layer in range(shape["layers"]):
            keys = random_rows(rows, heads=shape["kv_heads"], dim=shape["head_dim"]).to(dtype)
            cache.update(keys, keys.clone(), layer)
        sizes[fmt] = sum(layer.memory_bytes() for layer in cache.layers)
    ratio = sizes[name] / sizes["float"]
    assert ratio == (64 // 2 + 2) / (64 * 2) == 0.265625 and ratio <= 0.3
    assert sizes[name] == rows * bytes_per_token(name, dtype=torch.float16, **shape)


@pytest.mark.parametrize("name", FORMATS)
def test_re_rotation_error_bound(name):
    """decode -> rotate -> encode: per element at most sqrt(2)·h·s_old (the old rounding error,
    turned) + h·s_new (the new rounding), h = the format's half step; against the new scale
    alone at most rounding_bounds(1) = 3 rounding bounds. Re-rotating only the rows asked."""
    codec = PACKED[name]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    keys = random_rows(64)
    cache = SpliceCache(num_layers=1, max_cache_len=80, kv_format=name)
    cache.update(keys, keys.clone(), 0)
    before = cache.layers[0].keys
    old_scales = cache.layers[0].scales.keys[..., 0].float().unsqueeze(-1)
    cos, sin = rope.rotation(inv_freq, torch.arange(10, 64), torch.arange(10, 64) + 37)
    cache.rotate_keys(10, cos, sin)
    layer = cache.layers[0]
    assert torch.equal(layer.keys[:, :, :10], before[:, :, :10]) and torch.equal(layer.values, quantized(codec, keys))
    exact = rope.rotate(keys[:, :, 10:], cos, sin)
    new_scales = layer.scales.keys[:, :, 10:].float()
    error = (layer.keys[:, :, 10:] - exact).abs()
    bound = codec.half_step * (math.sqrt(2) * old_scales[:, :, 10:] + new_scales)
    assert bool((error <= bound * (1 + 1e-3) + 1e-6).all())
    in_rounding_bounds = error / codec.error_bound(layer.keys[:, :, 10:])
    assert float(in_rounding_bounds.max()) <= rounding_bounds(1) == 3
    assert torch.equal(layer.keys[:, :, 10:], quantized(codec, rope.rotate(before[:, :, 10:], cos, sin)))


# --- 3. the StateManager and the brain on packed rows ----------------------------------------


def edits(rng, length, vocab):
    """A random action list that never needs a re-rotation: deletes and pairs replaced by one
    token (each frees one row), then three adds."""
    rows = sorted(rng.sample(range(1, length - 1), 3))
    actions, taken = [], set()
    for row in rows:
        if row in taken or row + 1 in taken:
            continue
        if rng.random() < 0.5 and row + 1 < length - 1 and row + 1 not in rows:
            actions.append({"action": "replace_pair", "original_pos1": row, "original_pos2": row + 1,
                            "new_token_ids": [rng.randrange(vocab)]})
            taken |= {row, row + 1}
        else:
            actions.append({"action": "delete", "position": row})
            taken.add(row)
    return actions + [{"action": "add", "token_id": rng.randrange(vocab)} for _ in range(3)]


@pytest.mark.parametrize("name", FORMATS)
def test_edits_keep_layer0_equal_to_the_float_states_rows_quantized(tiny, name):
    """The same action lists on a float and a packed state: layer 0 depends only on token and
    position, so the packed state's layer 0 must be the float state's, quantized row by row,
    exactly, and its rows must follow the mirror (check(deep=True))."""
    codec, rng = PACKED[name], random.Random(5)
    tokens = [rng.randrange(tiny.vocab_size) for _ in range(40)]
    packed = StateManager.from_tokens(tiny, tokens, kv_format=name)
    reference = StateManager.from_tokens(tiny, tokens)
    for tick in range(1, 16):
        actions = edits(rng, len(reference), tiny.vocab_size)
        for sm in (packed, reference):
            report = sm.apply(actions, tick=tick)
            assert not report.rebuilt and report.rotated_rows == 0, report.error
        assert packed.live_token_ids() == reference.live_token_ids() and packed.positions() == reference.positions()
        got, want = packed.layer_kv(0), reference.layer_kv(0)
        assert torch.equal(got[0], quantized(codec, want[0])) and torch.equal(got[1], quantized(codec, want[1]))
        packed.check(deep=True)
    assert packed.positions() != list(range(len(packed))), "the edits left gaps"


@pytest.mark.parametrize("name", FORMATS)
def test_check_tolerance_follows_the_format(tiny, name, layer0_oracle):
    """The default tolerance of a packed state is its rounding bound (per row); the float
    tolerance is too tight for it, and rows that do not follow the mirror still fail."""
    sm = StateManager.from_tokens(tiny, list(range(3, 43)), kv_format=name)
    sm.check(deep=True)
    with pytest.raises(StateInvariantError, match="layer 0 differs from a fresh prefill"):
        sm.check(deep=True, tolerance=1e-4)
    keys = sm.layer_kv(0)[0]
    fresh = layer0_oracle(tiny, sm.live_token_ids(), sm.positions())[0]
    ratio = ((keys - fresh).abs() / PACKED[name].error_bound(keys)).max()
    assert 0.3 < float(ratio) <= 1.0 + 1e-3, "one rounding: within one bound (float noise aside)"
    layer = sm._cache.layers[0]
    for store in (layer.codes, layer.scales):  # swap rows 5 and 6 behind the mirror's back
        store.key_buffer[:, :, [layer.start + 5, layer.start + 6]] = store.key_buffer[:, :, [layer.start + 6, layer.start + 5]]
    with pytest.raises(StateInvariantError, match="layer 0 differs from a fresh prefill"):
        sm.check(deep=True)


@pytest.mark.parametrize("name", FORMATS)
def test_insertions_without_room_re_rotate_within_the_stated_bound(tiny, name, tmp_path):
    """Every re-rotation of a key is counted, and the deep check allows rounding_bounds(r) =
    2^(r+1) - 1 rounding bounds to a key re-rotated r times (values: 1); the counts survive a
    session."""
    tokens = list(range(3, 43))
    sm = StateManager.from_tokens(tiny, tokens, kv_format=name)
    reference = StateManager.from_tokens(tiny, tokens)
    codec = PACKED[name]
    for rounds, row in ((1, 10), (2, 20)):  # positions 0..39 leave no room: the rows right of `row` move
        for state in (sm, reference):
            report = state.insert(row, [7, 8, 9])
            assert not report.rebuilt and report.rotated_rows == len(state) - row - 3
        sm.check(deep=True)
        keys, exact = sm.layer_kv(0)[0], reference.layer_kv(0)[0]
        ratio = ((keys - exact).abs() / codec.error_bound(keys))[0, :, 23:].max()
        assert 1 < float(ratio) <= rounding_bounds(rounds), "more than one rounding, within the bound"
    assert sm._requantized == [0] * 10 + [0] * 3 + [1] * 7 + [0] * 3 + [2] * 23
    assert torch.equal(sm.layer_kv(0)[1], quantized(codec, reference.layer_kv(0)[1])), "values never move"
    restored = StateManager.from_saved(tiny, copy.deepcopy(sm.mirror), sm.tensors(), kv_format=name)
    assert restored._requantized == sm._requantized
    sm.rebuild()
    assert sm._requantized == [0] * len(sm)


def delete_and_restore_rows_5_and_6(sm):
    """Rows 5 and 6 deleted (and a token added), then restored with their own K/V as read."""
    view = sm.view(keys=True)
    keys, values = view.rows([5, 6])
    ids = [int(view.ledger_ids[r]) for r in (5, 6)]
    sm.apply([{"action": "delete", "position": 5}, {"action": "delete", "position": 6},
              {"action": "add", "token_id": 7}], tick=1)
    report = sm.apply([{"action": "restore", "ledger_ids": ids, "keys": keys, "values": values,
                        "predicted": [int(view.predicted[5]), int(view.predicted[6])]},
                       {"action": "add", "token_id": 9}], tick=2)
    assert not report.rebuilt, report.error


@pytest.mark.parametrize("name", FORMATS)
def test_a_restore_with_stored_kv_puts_the_same_codes_back(tiny, name):
    sm = StateManager.from_tokens(tiny, list(range(3, 43)), kv_format=name)
    layer = sm.cache.layers[1]
    codes = layer.codes.keys[:, :, [5, 6]].clone(), layer.scales.values[:, :, [5, 6]].clone()
    delete_and_restore_rows_5_and_6(sm)
    layer = sm.cache.layers[1]
    assert torch.equal(layer.codes.keys[:, :, [5, 6]], codes[0]) and torch.equal(layer.scales.values[:, :, [5, 6]], codes[1])
    sm.check(deep=True)


@pytest.mark.parametrize("name", FORMATS)
def test_a_brain_on_4bit_rows_stays_within_budget(tiny, name):
    config = BrainConfig(budget=40, kv_format=name, seed=1)
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)), config)
    for _ in range(60):
        record = brain.step()
        assert not record.rebuilt, record.error
        assert record.live_length <= config.budget
    assert brain.counts["culls"] > 0
    brain.state.check(deep=True)
    assert brain.state.cache.kv_format == name
    layers = brain.state.cache.layers
    row = tiny.num_kv_heads * (tiny.head_dim // 8 * 4 + 2)
    cache = brain.state.cache
    assert brain.state.memory_bytes() == sum(2 * l.capacity * row for l in layers) + \
        sum(s.memory_bytes() for s in cache.part_scratches)
    assert brain.state.bytes_per_token() == 2 * tiny.num_layers * row


def test_a_state_and_settings_that_disagree_on_the_format_are_refused(tiny):
    sm = StateManager.from_tokens(tiny, list(range(3, 43)), kv_format="int4")
    with pytest.raises(ValueError, match="stores its cache as int4, the settings say float"):
        Brain(sm, BrainConfig(budget=48))
    with pytest.raises(ValueError, match="unknown kv format 'nf4'"):
        BrainConfig(kv_format="nf4").validate()


@pytest.mark.parametrize("name", FORMATS)
def test_a_session_resumes_with_the_same_codes(tiny, tmp_path, name):
    """A session saves the rows decoded; in float32 they encode back to the same codes and
    scales, so the resumed run goes on exactly."""
    config = BrainConfig(budget=40, kv_format=name, seed=2)
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)), config)
    for _ in range(30):
        brain.step()
    sessions.save(tmp_path, brain, tiny.name)
    resumed = sessions.resume(tiny, tmp_path)
    assert resumed.config.kv_format == name and resumed.state.kv_format == name
    for a, b in zip(brain.state.cache.layers, resumed.state.cache.layers):
        assert torch.equal(a.codes.keys, b.codes.keys) and torch.equal(a.scales.values, b.scales.values)
    assert [brain.step().token_id for _ in range(15)] == [resumed.step().token_id for _ in range(15)]


# --- 4. the command line and the evaluation ----------------------------------------------------


def test_run_shows_the_format_and_its_bytes_per_token(tiny, capsys, run_cli):
    code = run_cli("--model", "random:tiny", "--ticks", "12", "--budget", "40", "--no-tui", "--no-input",
                   "--kv-format", "fp4")
    out = capsys.readouterr().out
    assert code == 0
    row = tiny.num_kv_heads * (tiny.head_dim // 8 * 4 + 2)
    assert f"(fp4, {2 * tiny.num_layers * row} B/token)" in out


def test_an_unknown_format_gives_one_line_and_exit_code_2(capsys, run_cli):
    assert run_cli("--model", "random:tiny", "--ticks", "2", "--no-tui", "--kv-format", "int8") == 2
    assert capsys.readouterr().err.strip() == "error: --kv-format: unknown kv format 'int8'; choose from float, int4, fp4, int4h"


def test_eval_runs_every_policy_and_the_reference_on_the_format(tiny, eval_text):
    report = evaluate(tiny, eval_text, policies=["streaming"], budgets=[40], max_tokens=70, probe=False, kv_format="int4")
    assert report.settings["kv_format"] == "int4"
    assert report.settings["kv_bytes_per_token"] == bytes_per_token("int4", layers=tiny.num_layers,
                                                                    kv_heads=tiny.num_kv_heads, head_dim=tiny.head_dim,
                                                                    dtype=tiny.dtype)
    assert all(math.isfinite(run.ppl) for run in report.runs + [report.reference])
    assert report.runs[0].deletes > 0


# --- 5. int4h: keys before RoPE and centred, Hadamard-rotated, int4 per group of 32 ------------


def test_int4h_round_trip_error_is_at_most_half_a_group_scale():
    codec = Int4H()
    c = random_rows(400, dim=64) + torch.linspace(-3, 5, 64)  # groups of mixed sign and all-positive ones
    c[0, 0, :5, 32:] = c[0, 0, :5, 32:].abs() + 1
    codes, scales, zeros = codec.encode(c)
    assert codes.shape == (1, KV_HEADS, 400, 8) and codes.dtype == torch.int32
    assert scales.shape == zeros.shape == (1, KV_HEADS, 400, 2) and scales.dtype == torch.float16
    assert zeros.dtype == torch.uint8 and int(zeros.max()) <= 15
    error = (codec.decode(codes, scales, zeros) - c).abs().reshape(1, KV_HEADS, 400, 2, 32)
    s = scales.float().unsqueeze(-1)
    assert bool((error <= s * codec.half_step).all()), float((error / s).max())
    assert float((error / s).max()) > 0.45, "the bound is tight"
    g = c.reshape(1, KV_HEADS, 400, 2, 32)
    span = g.amax(-1).clamp(min=0) - g.amin(-1).clamp(max=0)
    exact = span / 15
    assert bool(((scales.float() <= exact) & (scales.float() >= exact * (1 - 2**-10))).all()), \
        "scale = (max(group, 0) - min(group, 0)) / 15, to float16 toward 0"
    zero = torch.zeros(3, 64)
    assert torch.equal(codec.decode(*codec.encode(zero)), zero)


def test_int4h_decoded_rows_encode_back_to_the_same_codes():
    """What a session relies on: it saves decoded rows, and encoding them again is exact."""
    codec = Int4H()
    first = codec.encode(random_rows(300, dim=64) * 5)
    again = codec.encode(codec.decode(*first))
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_hadamard_is_orthogonal_and_needs_a_power_of_two():
    h = hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6) and torch.equal(h, h.T)
    assert set((h * 8).unique().tolist()) == {-1.0, 1.0}
    with pytest.raises(ValueError, match="head_dim a power of two, got 48"):
        hadamard(48)


def int4h_cache(tiny, capacity=64):
    return SpliceCache(tiny.model.config, max_cache_len=capacity, kv_format="int4h", key_centres=key_centres(tiny))


def int4h_quantized(tiny, keys, values, positions, layer=0):
    """K/V [1, kv_heads, n, head_dim] as layer `layer` of an int4h cache stores and reads them
    at `positions`, computed on their own (a fresh cache, one write)."""
    cache = int4h_cache(tiny, len(positions))
    cache.set_positions(positions)
    return cache.update(keys, values, layer)


def test_int4h_rows_are_read_at_the_positions_set_and_moving_them_is_exact(tiny):
    """Keys are stored un-rotated: the same codes read at new positions give the keys rotated
    there (float32 arithmetic aside), and rotate_keys changes nothing stored."""
    keys, values = random_rows(20, dim=tiny.head_dim), random_rows(20, dim=tiny.head_dim, seed=1)
    cache = int4h_cache(tiny)
    positions = torch.arange(100, 120)
    cache.set_positions(positions)
    read_keys, read_values = cache.update(keys, values, 0)
    layer = cache.layers[0]
    stored = layer.codes.keys.clone()
    bound = Int4H().error_bound(layer.coded_keys(read_keys, positions))
    assert bool(((read_keys - keys).abs() <= bound + 1e-5).all()), "one rounding, within the stated bound"
    moved = positions + 37
    cos, sin = rope.rotation(tiny.inv_freq, positions, moved)
    cache.rotate_keys(0, cos, sin)
    cache.set_positions(moved)
    assert torch.equal(layer.codes.keys, stored)
    torch.testing.assert_close(layer.keys, rope.rotate(read_keys, cos, sin), atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.values, read_values)


def test_int4h_needs_positions_after_a_splice_and_counts_rows_without_them(tiny):
    cache = int4h_cache(tiny)
    keys = random_rows(6, dim=tiny.head_dim)
    for layer in range(tiny.num_layers):
        plain = cache.update(keys, keys, layer)[0]  # nobody set positions: append-only, row i at position i
    assert torch.equal(plain, int4h_quantized(tiny, keys, keys, torch.arange(6), layer)[0])
    cache.splice([(0, 0, 2), (3, 2, 3)], 5)
    with pytest.raises(ValueError, match="needs their positions"):
        cache.layers[0].keys
    cache.set_positions([0, 1, 3, 4, 5])
    assert torch.equal(cache.layers[-1].keys, plain[:, :, [0, 1, 3, 4, 5]])


def test_int4h_in_a_users_generate_reads_each_row_at_its_position(tiny, layer0_oracle):
    """No one sets positions in a plain generate: row i is position i. Layer 0 depends only on
    token and position, so its rows must be the fresh ones within the format's bound."""
    ids = torch.tensor([[tiny.bos_id] + list(range(10, 30))])
    cache = int4h_cache(tiny, 16)  # grows on the way
    out = tiny.model.generate(ids, **with_cache(cache), max_new_tokens=8, do_sample=False)
    assert cache.length == out.shape[1] - 1  # the last token is never fed
    positions = torch.arange(cache.length)
    fresh_keys, fresh_values = layer0_oracle(tiny, out[0, :-1].tolist(), positions.tolist())
    layer = cache.layers[0]
    codec = Int4H()
    assert bool(((layer.keys - fresh_keys).abs() <= codec.error_bound(layer.coded_keys(layer.keys, positions)) + 1e-5).all())
    assert bool(((layer.values - fresh_values).abs() <= codec.error_bound(layer.coded_values(layer.values)) + 1e-5).all())
    shifted = codec.error_bound(layer.coded_keys(layer.keys, positions + 1))
    assert not bool(((layer.keys - rope.rotate(fresh_keys, *rope.rotation(tiny.inv_freq, positions, positions + 1))).abs()
                     <= shifted + 1e-5).all()), "read at the wrong positions, they would not match"


def test_int4h_refuses_a_head_dim_that_is_not_a_power_of_two(tiny):
    config = copy.deepcopy(tiny.model.config)
    config.head_dim = 24
    with pytest.raises(ValueError, match="head_dim must be a power of two, this model's is 24"):
        SpliceCache(config, kv_format="int4h")


@pytest.mark.parametrize("seed", range(3))
def test_int4h_splice_fill_append_and_growth_keep_each_row_as_encoded_at_its_position(tiny, seed):
    rng = random.Random(seed)
    packed, reference = int4h_cache(tiny, 40), SpliceCache(tiny.model.config, max_cache_len=40)
    positions: list[int] = []
    serial = iter(range(10**6))

    def write(count, fill=None):
        if fill is None:
            positions.extend(next(serial) for _ in range(count))
        else:
            for row in fill.tolist():
                positions[row] = next(serial)
        packed.set_positions(positions)
        for layer in range(tiny.num_layers):
            keys = random_rows(count, dim=tiny.head_dim, seed=next(serial))
            values = random_rows(count, dim=tiny.head_dim, seed=next(serial))
            for cache in (packed, reference):
                with cache.fill(fill) if fill is not None else contextlib.nullcontext():
                    cache.update(keys, values, layer)

    write(24)
    for _ in range(20):
        kept, length = random_kept(rng, reference.length)
        for cache in (packed, reference):
            cache.splice(kept, length)
        moved = [None] * length
        for old, new, count in kept:
            moved[new:new + count] = positions[old:old + count]
        positions[:] = [p if p is not None else -1 for p in moved]
        covered = {new + k for _, new, count in kept for k in range(count)}
        gaps = torch.tensor([row for row in range(length) if row not in covered], dtype=torch.long)
        if len(gaps):
            write(len(gaps), fill=gaps)
        else:
            packed.set_positions(positions)
        write(rng.choice([1, 2, 5]))
        for layer, (got, want) in enumerate(zip(packed.layers, reference.layers)):
            keys, values = int4h_quantized(tiny, want.keys, want.values, positions, layer)
            assert torch.equal(got.keys, keys) and torch.equal(got.values, values)
        if reference.length > 70:
            for cache in (packed, reference):
                cache.splice([(0, 0, 30)], 30)
            del positions[30:]
            packed.set_positions(positions)
    assert packed.layers[0].capacity > 40, "it grew"


@pytest.mark.parametrize("shape", [dict(layers=30, kv_heads=3, head_dim=64),   # SmolLM2-135M
                                   dict(layers=22, kv_heads=4, head_dim=64)])  # TinyLlama-1.1B
def test_int4h_takes_at_most_0_3_of_float16(shape):
    per_token = bytes_per_token("int4h", dtype=torch.float16, **shape)
    row = 64 // 2 + 2 * 2 + 2  # codes, two float16 scales, two one-byte zero points
    assert per_token == 2 * shape["layers"] * shape["kv_heads"] * row + 8  # + the row's position
    assert per_token / bytes_per_token("float", dtype=torch.float16, **shape) <= 0.3


def test_int4h_memory_is_exact_and_steady_state_edits_never_allocate(tiny):
    cache = int4h_cache(tiny, 160)
    cache.set_positions(range(100))
    for layer in range(tiny.num_layers):
        cache.update(random_rows(100, dim=tiny.head_dim), random_rows(100, dim=tiny.head_dim), layer)
    buffers = [(layer.codes.key_buffer, layer.zeros.value_buffer) for layer in cache.layers]
    positions = list(range(100))
    for tick in range(30):  # a tick: replace a pair near the front by one token, append one
        cache.splice([(0, 0, 10), (12, 11, 88)], 99)
        positions = positions[:10] + [positions[10]] + positions[12:]
        cache.set_positions(positions + [1000 + tick])
        with cache.fill(torch.tensor([10])):
            for layer in range(tiny.num_layers):
                cache.update(random_rows(1, dim=tiny.head_dim), random_rows(1, dim=tiny.head_dim), layer)
        for layer in range(tiny.num_layers):
            cache.update(random_rows(1, dim=tiny.head_dim), random_rows(1, dim=tiny.head_dim), layer)
        positions.append(1000 + tick)
    assert all(layer.codes.key_buffer is k and layer.zeros.value_buffer is z
               for layer, (k, z) in zip(cache.layers, buffers))
    row = tiny.num_kv_heads * Int4H().row_bytes(tiny.head_dim)
    scratch = sum(s.memory_bytes() for s in cache.part_scratches)
    assert cache.memory_bytes() == 2 * tiny.num_layers * 160 * row + scratch + 8 * 100


def test_int4h_edits_keep_layer0_equal_to_the_float_states_rows_encoded_at_their_positions(tiny):
    rng = random.Random(5)
    tokens = [rng.randrange(tiny.vocab_size) for _ in range(40)]
    packed = StateManager.from_tokens(tiny, tokens, kv_format="int4h")
    reference = StateManager.from_tokens(tiny, tokens)
    for tick in range(1, 12):
        actions = edits(rng, len(reference), tiny.vocab_size)
        for sm in (packed, reference):
            report = sm.apply(actions, tick=tick)
            assert not report.rebuilt, report.error
        assert packed.live_token_ids() == reference.live_token_ids() and packed.positions() == reference.positions()
        want = int4h_quantized(tiny, *reference.layer_kv(0), packed.positions())
        got = packed.layer_kv(0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        packed.check(deep=True)
    assert packed.positions() != list(range(len(packed))), "the edits left gaps"


def test_int4h_check_tolerance_and_what_it_catches(tiny, layer0_oracle):
    sm = StateManager.from_tokens(tiny, list(range(3, 43)), kv_format="int4h")
    sm.check(deep=True)
    with pytest.raises(StateInvariantError, match="layer 0 differs from a fresh prefill"):
        sm.check(deep=True, tolerance=1e-4)
    keys, values = sm.layer_kv(0)
    fresh_keys, fresh_values = layer0_oracle(tiny, sm.live_token_ids(), sm.positions())
    layer = sm._cache.layers[0]
    positions = torch.tensor(sm.positions())
    ratio = ((keys - fresh_keys).abs() / Int4H().error_bound(layer.coded_keys(keys, positions))).max()
    assert 0.02 < float(ratio) <= 1.0, "within the bound"
    assert float(((values - fresh_values).abs() / Int4H().error_bound(layer.coded_values(values))).max()) <= 1.0
    sm._cache.set_positions(sm.positions()[:5] + [sm.positions()[6], sm.positions()[5]] + sm.positions()[7:])
    with pytest.raises(StateInvariantError, match="row positions"):
        sm.check()
    sm._cache.set_positions(sm.positions())
    for store in (layer.codes, layer.scales, layer.zeros):  # swap rows 5 and 6 behind the mirror's back
        store.key_buffer[:, :, [layer.start + 5, layer.start + 6]] = store.key_buffer[:, :, [layer.start + 6, layer.start + 5]]
    with pytest.raises(StateInvariantError, match="layer 0 differs from a fresh prefill"):
        sm.check(deep=True)


def test_int4h_insertions_without_room_move_keys_exactly(tiny):
    tokens = list(range(3, 43))
    sm = StateManager.from_tokens(tiny, tokens, kv_format="int4h")
    reference = StateManager.from_tokens(tiny, tokens)
    for row in (10, 20):  # positions 0..39 leave no room: the rows right of `row` move
        for state in (sm, reference):
            report = state.insert(row, [7, 8, 9])
            assert not report.rebuilt and report.rotated_rows == len(state) - row - 3
        sm.check(deep=True)
    assert sm._requantized == [0] * len(sm), "nothing was rounded again"
    moved = int4h_quantized(tiny, *reference.layer_kv(0), sm.positions())
    torch.testing.assert_close(sm.layer_kv(0)[0], moved[0], atol=1e-4, rtol=1e-4)


def test_int4h_restore_session_and_brain(tiny, tmp_path):
    """A restore with stored K/V passes the deep check; a session resumes with the same codes
    and goes on exactly; a brain stays within budget and counts its bytes."""
    sm = StateManager.from_tokens(tiny, list(range(3, 43)), kv_format="int4h")
    delete_and_restore_rows_5_and_6(sm)
    sm.check(deep=True)

    config = BrainConfig(budget=40, kv_format="int4h", seed=2)
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)), config)
    for _ in range(40):
        record = brain.step()
        assert not record.rebuilt and record.live_length <= 40, record.error
    assert brain.counts["culls"] > 0
    brain.state.check(deep=True)
    per_token = bytes_per_token("int4h", layers=tiny.num_layers, kv_heads=tiny.num_kv_heads, head_dim=tiny.head_dim,
                                dtype=tiny.dtype)
    assert brain.state.bytes_per_token() == per_token
    sessions.save(tmp_path, brain, tiny.name)
    resumed = sessions.resume(tiny, tmp_path)
    assert resumed.state.kv_format == "int4h"
    for a, b in zip(brain.state.cache.layers, resumed.state.cache.layers):
        assert all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
                   for x, y in zip(a.parts, b.parts))
    assert [brain.step().token_id for _ in range(15)] == [resumed.step().token_id for _ in range(15)]


@pytest.mark.parametrize("stage", FAULT_STAGES)
def test_int4h_a_fault_at_any_stage_leaves_the_state_as_it_was(tiny, stage):
    """A failed edit rebuilds the cache from the mirror: the same live rows at the same
    positions, the cache's positions with them, layer 0 re-encoded from a fresh prefill."""
    sm = StateManager.from_tokens(tiny, list(range(3, 43)), kv_format="int4h")
    sm.apply([{"action": "delete", "position": 7}, {"action": "add", "token_id": 5}], tick=1)
    before = (sm.live_token_ids(), sm.positions())
    sm.inject_fault(stage)
    report = sm.apply([{"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": [8]},
                       {"action": "delete", "position": 9}, {"action": "add", "token_id": 7}], tick=2)
    assert report.rebuilt and "InjectedFault" in report.error
    assert (sm.live_token_ids(), sm.positions()) == before
    assert sm.cache.positions.tensor[: len(sm)].tolist() == before[1]
    sm.check(deep=True)
    assert not sm.apply([{"action": "add", "token_id": 7}], tick=3).rebuilt
    sm.check(deep=True)


@pytest.mark.parametrize("repairer", ["bridge", "self"])
def test_int4h_under_repairs_probes_and_recall(tiny, repairer):
    """Repairs fill gaps, the bridge's probes write scratch rows after the live ones (their
    positions set with the rest), recall restores rows: the deep check holds throughout."""
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 60)),
                        BrainConfig(budget=48, kv_format="int4h", repairer=repairer, recall=True, seed=2))
    for tick in range(80):
        record = brain.step()
        assert not record.rebuilt, record.error
        if tick % 20 == 19:
            brain.state.check(deep=True)
    assert brain.counts["repairs"] > 0


def test_int4h_refuses_bad_saved_rows_and_centres_with_one_line(tiny):
    sm = StateManager.from_tokens(tiny, list(range(3, 30)), kv_format="int4h")
    tensors = sm.tensors()
    for name, value, message in (("key_zeros", 16, "zero points must lie in 0..15"),
                                 ("value_scales", -1.0, "scales be >= 0")):
        bad = dict(tensors)
        bad[name] = bad[name].clone()
        bad[name][0, 0, 0, 0] = value
        with pytest.raises(ValueError, match=message):
            StateManager.from_saved(tiny, copy.deepcopy(sm.mirror), bad, kv_format="int4h")
    bad = {k: v for k, v in tensors.items() if k != "value_codes"}
    with pytest.raises(ValueError, match="saved tensor 'value_codes' is missing"):
        StateManager.from_saved(tiny, copy.deepcopy(sm.mirror), bad, kv_format="int4h")
    with pytest.raises(ValueError, match="3 key centres for 2 layers"):
        SpliceCache(tiny.model.config, kv_format="int4h", key_centres=torch.zeros(3, tiny.num_kv_heads, tiny.head_dim))
    sm.check(deep=True)  # the state they were taken from is untouched


def test_int4h_in_float16(tiny_half):
    """The dtype a GPU runs by default: rows decode into it, and the deep check (half's
    tolerance on top of the format's bound) holds after ticks and after rows were moved."""
    brain = Brain.start(tiny_half, [tiny_half.bos_id] + list(range(10, 30)),
                        BrainConfig(budget=48, kv_format="int4h", seed=3))
    for _ in range(60):
        record = brain.step()
        assert not record.rebuilt, record.error
    assert brain.state.cache.layers[0].keys.dtype == torch.float16 and brain.counts["culls"] > 0
    brain.state.check(deep=True)
    sm = StateManager.from_tokens(tiny_half, list(range(3, 43)), kv_format="int4h")
    report = sm.insert(10, [7, 8, 9])  # positions 0..39 leave no room: the rows right of 10 move
    assert not report.rebuilt and report.rotated_rows == len(sm) - 13
    sm.check(deep=True)


def test_int4h_from_the_command_line(tiny, capsys, run_cli, eval_text):
    assert run_cli("--model", "random:tiny", "--ticks", "12", "--budget", "40", "--no-tui", "--no-input",
                   "--kv-format", "int4h") == 0
    per_token = bytes_per_token("int4h", layers=tiny.num_layers, kv_heads=tiny.num_kv_heads, head_dim=tiny.head_dim,
                                dtype=tiny.dtype)
    assert f"(int4h, {per_token} B/token)" in capsys.readouterr().out
    report = evaluate(tiny, eval_text, policies=["streaming"], budgets=[40], max_tokens=70, probe=False,
                      kv_format="int4h")
    assert report.settings["kv_format"] == "int4h" and all(math.isfinite(r.ppl) for r in report.runs)
