"""The ring store (positronic/kv/ring.py RingLayer, kv_store="ring"): streaming on it is the
streaming of the splice store, without moving a row."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from positronic.brain import session as sessions
from positronic.kv.cache import SpliceCache
from positronic.evaluate import make_config, run_stream
from positronic.brain.loop import Brain, BrainConfig
from positronic.mirror import Ring
from positronic.state import FAULT_STAGES, StateManager
from positronic.models import with_cache

PROMPT = list(range(10, 30))


def config(store, **changes):
    return BrainConfig(policy="streaming", budget=48, kv_store=store, seed=3, **changes)


def brains(tiny, **changes):
    prompt = [tiny.bos_id] + PROMPT
    return Brain.start(tiny, prompt, config("splice", **changes)), Brain.start(tiny, prompt, config("ring", **changes))


def test_teacher_forced_streaming_scores_the_text_as_the_splice_store_does(tiny, eval_text):
    ids = [tiny.bos_id] + tiny.encode(eval_text)[:150]
    splice = run_stream(tiny, ids, make_config("streaming", 48))
    ring = run_stream(tiny, ids, make_config("streaming", 48, kv_store="ring"))
    assert splice.deletes == ring.deletes > 60
    # the same rows, attended in another order: only the summation order differs
    torch.testing.assert_close(torch.tensor(ring.nll), torch.tensor(splice.nll), atol=1e-5, rtol=0)


def test_sampled_streaming_makes_the_same_tokens_and_logits_without_moving_a_row(tiny):
    splice, ring = brains(tiny)
    layer = ring.state._cache.layers[0]  # the real buffers (the view's tensors are clones)
    buffers = (layer.key_buffer.data_ptr(), layer.value_buffer.data_ptr())
    cursors = []
    for _ in range(200):
        a, b = splice.step(), ring.step()
        assert a.token_id == b.token_id and a.actions == b.actions
        torch.testing.assert_close(ring.state.next_logits, splice.state.next_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(ring.state.last_attention, splice.state.last_attention, atol=1e-6, rtol=0)
        cursors.append(ring.state.mirror.ring.cursor)
    assert splice.counts["culls"] > 100
    assert any(later < earlier for earlier, later in zip(cursors, cursors[1:])), "the cursor wrapped round"
    assert all(layer.moved_rows == 0 for layer in ring.state.cache.layers)
    assert (layer.key_buffer.data_ptr(), layer.value_buffer.data_ptr()) == buffers, "no new buffer"
    assert ring.state.cache.ring == ring.state.mirror.ring
    assert ring.state.live_token_ids() == splice.state.live_token_ids()
    ring.state.check(deep=True)
    for index in range(tiny.num_layers):
        for got, want in zip(ring.state.layer_kv(index), splice.state.layer_kv(index)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_eviction_runs_no_tensor_op_and_the_tick_writes_one_slot(tiny):
    """In steady state a streaming splice is arithmetic on the cursor (no tensor op at all,
    wrapped or not), and an evicting tick changes exactly one slot per layer: the new row's."""
    cache = SpliceCache(num_layers=2, max_cache_len=20, store="ring", sinks=4)
    rows = torch.randn(1, 2, 20, 8)
    for layer in cache.layers:
        layer.update(rows, rows)
    with Ops() as seen:
        for _ in range(12):  # drop the 3 oldest window rows, open one new row: round and round
            cache.splice([(0, 0, 4), (7, 4, 13)], 18)
            cache.crop(-1)
            cache.splice([(0, 0, 17)], 20 - 2)  # two appended rows, written by nobody: only slots move
            cache.splice([(0, 0, 18)], 20)
    assert seen.ops == []
    assert cache.ring.cursor != 4 and all(layer.moved_rows == 0 for layer in cache.layers)
    brain = brains(tiny)[1]
    while len(brain.state) < brain.config.budget:
        brain.step()
    before = [layer.key_buffer.clone() for layer in brain.state.cache.layers]
    record = brain.step()
    assert any(a["action"] == "delete" for a in record.actions), "this tick evicts"
    for layer, old in zip(brain.state.cache.layers, before):
        changed = (layer.key_buffer != old).any(dim=-1).any(dim=1)[0].nonzero().flatten().tolist()
        assert changed == [brain.state.mirror.ring.slot(len(brain.state) - 1)]


def test_check_after_the_ring_wraps_and_its_cursor_is_checked(tiny):
    _, brain = brains(tiny)
    seen = set()
    while len(seen) < 3 or brain.state.mirror.ring.cursor in (brain.state.mirror.ring.sinks,):
        brain.step()
        seen.add(brain.state.mirror.ring.cursor)
    brain.state.check(deep=True)
    state = brain.state
    state._mirror.ring = Ring(state.mirror.ring.sinks, state.mirror.ring.capacity,
                             state.mirror.ring.sinks + (state.mirror.ring.cursor - state.mirror.ring.sinks + 1)
                             % state.mirror.ring.window)
    with pytest.raises(AssertionError, match="ring"):
        state.check()


def mid_ring(tiny, ticks=70):
    """A ring brain after at least `ticks` ticks, at a tick where its window has wrapped."""
    _, brain = brains(tiny)
    for _ in range(ticks):
        brain.step()
    while brain.state.mirror.ring.linear(len(brain.state)) or brain.state.mirror.ring.used(len(brain.state)) \
            < brain.state.mirror.ring.capacity:
        brain.step()
    ring = brain.state.mirror.ring
    assert ring.cursor != ring.sinks and not ring.linear(len(brain.state)), "the test needs a wrapped ring"
    return brain


def test_a_session_saved_mid_ring_resumes_into_the_same_slots_and_goes_on_exactly(tiny, tmp_path):
    straight = mid_ring(tiny)
    brain = mid_ring(tiny)
    sessions.save(tmp_path / "s", brain, tiny.name)
    resumed = sessions.resume(tiny, tmp_path / "s")
    assert resumed.state.mirror.ring == brain.state.mirror.ring == resumed.state.cache.ring
    used = brain.state.mirror.ring.used(len(brain.state))
    slots = brain.state.cache.slot_index(len(brain.state))
    for old, new in zip(brain.state.cache.layers, resumed.state.cache.layers):
        assert torch.equal(old.key_buffer.index_select(2, slots), new.key_buffer.index_select(2, slots))
    assert used == resumed.state.cache.ring.used(len(resumed.state))
    assert [r.token_id for r in (straight.step() for _ in range(40))] == \
        [r.token_id for r in (resumed.step() for _ in range(40))]
    resumed.state.check(deep=True)
    # the splice store cannot take a ring's mirror
    with pytest.raises(ValueError, match="kv_store ring"):
        StateManager.from_mirror(tiny, resumed.state.mirror)


def test_a_resumed_wrapped_ring_reads_no_slot_it_never_wrote(tiny, tmp_path, nan_fill):
    """The resumed ring is laid out from a cursor past the sinks, with free slots between the
    newest window row and the oldest: never written after the resume, yet among the slots the
    attention reads (masked). Each new buffer starts as NaN here: a masked NaN still poisons
    the softmax, so the logits stay finite only if those slots were made harmless."""
    brain = mid_ring(tiny)
    while not brain.state.mirror.ring.free(len(brain.state)):
        brain.step()
    sessions.save(tmp_path / "s", brain, tiny.name)
    resumed = sessions.resume(tiny, tmp_path / "s")
    for _ in range(20):
        resumed.step()
        assert bool(torch.isfinite(resumed.state.next_logits).all())
    resumed.state.check(deep=True)


def used_slots_after(cache, rows):
    """What attention reads after appending `rows` [1, kv_heads, n, head_dim] to every layer."""
    return [layer.update(rows, rows) for layer in cache.layers]


def test_free_slots_among_the_used_ones_hold_written_rows_or_zeros(nan_fill):
    """Every way free slots join the slots a forward reads: a ring laid out from a recorded
    cursor (a resume or a rebuild), a cursor moved back by an insertion before the longest run,
    growth. New buffers are NaN here: each returned slot must be finite, and the free ones
    that were never written zero."""
    rows = torch.randn(1, 2, 18, 8)
    cache = SpliceCache(num_layers=2, max_cache_len=20, store="ring", sinks=4)
    cache.set_ring(Ring(4, 20, 9))
    for keys, values in used_slots_after(cache, rows):
        assert keys.shape[2] == 20 and bool(torch.isfinite(keys).all() & torch.isfinite(values).all())
        free = list(cache.ring.free(18))
        assert free == [7, 8] and not keys[:, :, free].any() and not values[:, :, free].any()

    cache = SpliceCache(num_layers=2, max_cache_len=20, store="ring", sinks=4)
    used_slots_after(cache, rows[:, :, :10])
    cache.splice([(0, 0, 4), (4, 5, 6)], 11)  # one row inserted at row 4: the cursor goes back to slot 19
    assert cache.ring.cursor == 19 and list(cache.ring.free(11)) == list(range(10, 19))
    with cache.fill(torch.tensor([4])):
        for layer in cache.layers:
            keys, values = layer.update(rows[:, :, :1], rows[:, :, :1])
            assert keys.shape[2] == 20 and bool(torch.isfinite(keys).all() & torch.isfinite(values).all())
    # later reads do not clear again (a streaming tick does no tensor op), and stay finite
    cache.crop(-1)
    for keys, values in used_slots_after(cache, rows[:, :, :1]):
        assert bool(torch.isfinite(keys).all() & torch.isfinite(values).all())

    cache.splice([(0, 0, 11)], 30)  # growth: a new, larger buffer with every kept row copied in
    with cache.fill(torch.arange(11, 30)):
        for layer in cache.layers:
            keys, values = layer.update(torch.randn(1, 2, 19, 8), torch.randn(1, 2, 19, 8))
            assert bool(torch.isfinite(keys).all() & torch.isfinite(values).all())


def test_a_splice_session_file_carries_no_ring(tiny, tmp_path):
    brain, _ = brains(tiny)
    sessions.save(tmp_path / "s", brain, tiny.name)
    saved, meta = sessions.load(tmp_path / "s")
    assert saved.ring is None and meta["config"]["kv_store"] == "splice"


@pytest.mark.parametrize("stage", FAULT_STAGES)
def test_a_fault_at_any_stage_of_an_eviction_tick_leaves_the_state_as_it_was(tiny, stage):
    """The tick does not happen: the same live rows, ledger and cursor, layer 0 as it was, and
    the rebuilt rows equal those of the splice store rebuilt by the same fault."""
    splice, brain = brains(tiny)
    while len(brain.state) < brain.config.budget or brain.state.mirror.ring.linear(len(brain.state)):
        splice.step(), brain.step()
    state = brain.state
    before = (list(state.mirror.live.ledger_ids), list(state.mirror.live.positions), state.mirror.ring,
              len(state.mirror.ledger))
    layer0 = state.layer_kv(0)
    actions = [{"action": "delete", "position": 4}, {"action": "delete", "position": 5}, {"action": "add", "token_id": 7}]
    for one in (splice.state, state):
        one.inject_fault(stage)
        report = one.apply(actions)
        assert report.rebuilt and "InjectedFault" in report.error
    after = (list(state.mirror.live.ledger_ids), list(state.mirror.live.positions), state.mirror.ring,
             len(state.mirror.ledger))
    assert after == before
    assert state.cache.ring == before[2], "the rebuild refills the recorded slots"
    for got, want in zip(state.layer_kv(0), layer0):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for index in range(tiny.num_layers):
        for got, want in zip(state.layer_kv(index), splice.state.layer_kv(index)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    state.check(deep=True)
    assert not state.apply(actions).rebuilt
    state.check(deep=True)


def test_other_edits_and_growth_work_on_the_ring_by_moving_the_rows_they_must(tiny):
    """Not streaming's, but still right: a delete in the middle, an insertion, a restore and
    growth past the capacity give the splice store's rows."""
    ids = [tiny.bos_id] + PROMPT
    a = StateManager.from_tokens(tiny, ids)
    b = StateManager.from_tokens(tiny, ids, kv_store="ring", sinks=4, capacity=len(ids))
    edits = [lambda s: s.apply([{"action": "delete", "position": 4}, {"action": "delete", "position": 5},
                                {"action": "add", "token_id": 3}]),
             lambda s: s.delete(9), lambda s: s.insert(6, [11, 12, 13]), lambda s: s.append([14] * 12),
             lambda s: s.apply([{"action": "restore", "ledger_ids": [5]}, {"action": "add", "token_id": 9}])]
    for edit in edits:
        for state in (a, b):
            assert not edit(state).rebuilt
        b.check(deep=True)
        assert b.live_token_ids() == a.live_token_ids() and b.mirror.ring == b.cache.ring
        torch.testing.assert_close(b.next_logits if b.next_logits is not None else torch.zeros(1),
                                   a.next_logits if a.next_logits is not None else torch.zeros(1), atol=1e-5, rtol=0)
        for index in range(tiny.num_layers):
            torch.testing.assert_close(b.layer_kv(index)[0], a.layer_kv(index)[0], atol=1e-5, rtol=0)
    assert b.mirror.ring.capacity > len(ids), "the ring grew"
    assert sum(layer.moved_rows for layer in b.cache.layers) > 0


def test_generate_with_a_ring_cache_equals_the_splice_cache(tiny):
    ids = torch.tensor([[tiny.bos_id] + PROMPT])
    outputs = []
    for store in ("splice", "ring"):
        cache = SpliceCache(tiny.model.config, max_cache_len=16, store=store, sinks=4)  # grows once
        outputs.append(tiny.model.generate(ids, **with_cache(cache), max_new_tokens=8, do_sample=False))
    assert torch.equal(outputs[0], outputs[1])


def test_the_tensor_slot_map_is_the_ring_s():
    cache = SpliceCache(num_layers=1, max_cache_len=11, store="ring", sinks=3)
    layer = cache.layers[0]
    layer.set_ring(Ring(3, 11, 9))
    for length in range(12):
        assert layer.slot_index(length).tolist() == layer.ring.slots(range(length))
        rows = layer.slot_rows(length).tolist()
        assert len(rows) == layer.ring.used(length)
        assert all(rows[layer.ring.slot(r)] == r for r in range(length))
        assert sum(r < 0 for r in rows) == len(rows) - length


def test_the_ring_refuses_what_it_cannot_keep(tiny, run_cli, capsys):
    with pytest.raises(ValueError, match="ring store keeps float rows"):
        SpliceCache(tiny.model.config, store="ring", kv_format="int4")
    with pytest.raises(ValueError, match="unknown kv store"):
        SpliceCache(tiny.model.config, store="heap")
    for changes, message in ((dict(policy="h2o"), "only the streaming policy"),
                             (dict(policy="streaming", kv_format="int4"), "keeps float rows")):
        with pytest.raises(ValueError, match=message):
            BrainConfig(**{"budget": 48, "kv_store": "ring", **changes}).validate()
    state = StateManager.from_tokens(tiny, [tiny.bos_id] + PROMPT, kv_store="ring", sinks=4)
    with pytest.raises(ValueError, match="splice store"):
        state.split_layers()
    # refused before the model loads: this model does not exist
    assert run_cli("--model", "random:nonexistent", "--kv-store", "ring", "--policy", "scored", "-n", "1",
                   "--no-tui") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "only the streaming policy" in err[0]
    assert run_cli("eval", "--model", "random:nonexistent", "--kv-store", "ring", "--out", "/tmp") == 2
    assert "only the streaming policy" in capsys.readouterr().err
