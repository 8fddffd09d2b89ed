"""SmartKV with recall and pins: a token some lanes dropped comes back into the lanes that look
for it, exactly as it was; a pinned token stays in every lane.

Exactness is checked as in test_policy.py: after every tick the brain's logits equal a plain
transformers forward over exactly the positions each lane holds (`Reference`), so a restored
row that came back with other K/V, at another position or into another lane, would show."""

import pytest
import torch

from positronic.brain import session as sessions
from positronic.brain.loop import Brain
from positronic.kv.formats import bytes_per_token
from positronic.mirror import to_bytes
from positronic.smartkv import recall as lane_recall
from positronic.smartkv.policy import SmartKVPolicy
from positronic.state.actions import ActionError

from .test_policy import (BUDGET, Reference, any_gate_file, config, gate_file,  # noqa: F401 (fixtures)
                          head_gate_file, layer_positions, text_ids)


@pytest.fixture
def eager_recall(monkeypatch):
    """A token comes back when a lane lacking it would give it a fair share of its attention
    (1 / BUDGET; the default asks for as much as all its rows: the tiny random model's
    attention is flat, its best dropped token gets about 1.05× a fair share)."""
    monkeypatch.setattr(SmartKVPolicy, "recall_share", 1.0 / BUDGET)


def run_checked(lm, brain, ids, start: int) -> list[dict]:
    """Force ids[start:] one per tick, checking every tick's logits against the reference over
    each lane's rows; returns the restore actions."""
    reference = Reference(lm, ids[:start])
    restores = []
    for n in range(start, len(ids)):
        record = brain.step(force=ids[n])
        assert not record.rebuilt, record.error
        assert record.live_length == min(n + 1, BUDGET)
        restores += [a for a in record.actions if a["action"] == "restore"]
        kept = layer_positions(brain.state)
        before = [[p for p in lane if p != n] for lane in kept]
        torch.testing.assert_close(brain.state.next_logits, reference.step(before, ids[n], n), atol=1e-4, rtol=1e-4)
    return restores


def test_dropped_tokens_come_back_into_the_lanes_that_lack_them_exactly(tiny, any_gate_file, eager_recall):
    ids = text_ids(tiny, 90, seed=31)  # lanes: kv heads (their rows in one Slab), or whole layers
    brain = Brain.start(tiny, ids[:15], config(any_gate_file, recall=True))
    restores = run_checked(tiny, brain, ids, 15)
    assert restores, "recall should bring tokens back"
    lanes = brain.state.lanes
    assert any(len(taking) < lanes for action in restores for taking in action["lanes"]), \
        "some token should come back into some lanes only"
    assert brain.policy.recall.restored == sum(len(a["ledger_ids"]) for a in restores)
    brain.state.check(deep=True)


def test_with_reread_the_token_a_look_was_for_is_predicted_with_what_came_back(tiny, any_gate_file, eager_recall):
    """`reread`: recall looks right after the tick's forward, with the query it made, and the
    newest row's forward runs again over the lanes with what came back. Every tick's logits
    still equal plain transformers over exactly the rows each lane holds (the reread row's K/V
    included); every restore comes after the tick's add, with a reread; the plan never looks."""
    ids = text_ids(tiny, 90, seed=31)
    brain = Brain.start(tiny, ids[:15], config(any_gate_file, recall=True))
    assert brain.config.reread and brain.policy.reread, "on by default with recall"
    reference = Reference(tiny, ids[:15])
    rereads = 0
    for n in range(15, len(ids)):
        plan = brain.policy.plan(brain.state.view(keys=True), [], {})
        assert not any(action["action"] == "restore" for action in plan.actions), "the plan does not look"
        record = brain.step(force=ids[n])
        assert not record.rebuilt, record.error
        kinds = [action["action"] for action in record.actions]
        if "restore" in kinds:
            rereads += 1
            assert kinds.index("add") < kinds.index("restore") and kinds[-1] == "reread"
            assert record.outcomes[-1][1].startswith("recalled")
        else:
            assert "reread" not in kinds
        kept = layer_positions(brain.state)
        before = [[p for p in lane if p != n] for lane in kept]
        torch.testing.assert_close(brain.state.next_logits, reference.step(before, ids[n], n), atol=1e-4, rtol=1e-4)
    assert rereads and brain.policy.recall.restored > 0 and brain.counts["rebuilds"] == 0
    brain.state.check(deep=True)


def test_a_reread_is_captured_as_its_own_fixture_and_replays_exactly(tiny, head_gate_file, eager_recall, tmp_path):
    from positronic.fixtures import Capture, load_fixture, replay

    ids = text_ids(tiny, 60, seed=31)
    brain = Brain.start(tiny, ids[:15], config(head_gate_file, recall=True))
    capture = Capture(tmp_path, tiny, "all", limit=1000, log=open(tmp_path / "log", "w"))
    brain.observers.append(capture)
    for token in ids[15:]:
        brain.step(force=token)
    rereads = sorted(tmp_path.glob("tick*-reread.pt"))
    assert rereads and len(capture.written) == brain.tick + len(rereads)
    for path in rereads:
        fixture = load_fixture(path)
        assert fixture.actions[-1] == {"action": "reread"} and (tmp_path / path.name.replace("-reread", "")).is_file()
        result = replay(fixture, tiny)
        assert result.passed, result.failed()


def test_one_recall_brings_back_at_most_an_eighth_of_a_lanes_memory(tiny, head_gate_file, eager_recall):
    """16 tokens around a match, or an eighth of the memory when that is fewer: a 12.5% budget's
    memory (60 rows for 1,024 tokens) would give up a quarter of itself for one recall."""
    assert [SmartKVPolicy.recall_span(m) for m in (3, 60, 124, 1000)] == [1, 7, 15, 16]
    ids = text_ids(tiny, 90, seed=31)
    brain = Brain.start(tiny, ids[:15], config(head_gate_file, recall=True, window=2))  # memory 15 rows: span 1
    assert brain.policy.size == 15 and brain.policy.recall.span == 1
    restores = []
    for token in ids[15:]:
        record = brain.step(force=token)
        assert not record.rebuilt, record.error
        restores += [a for a in record.actions if a["action"] == "restore"]
    assert restores, "recall should bring tokens back"
    assert max(len(action["ledger_ids"]) for action in restores) == 1


def test_recall_off_keeps_what_it_kept_before(tiny, head_gate_file):
    """Recall is additive: without it the same run drops what it always dropped (no restore)."""
    ids = text_ids(tiny, 60, seed=32)
    brain = Brain.start(tiny, ids[:15], config(head_gate_file))
    assert run_checked(tiny, brain, ids, 15) == []


@pytest.mark.parametrize("reread", [False, True], ids=["look in the plan", "reread"])
def test_a_session_with_recall_and_pins_resumes_exactly(tiny, head_gate_file, eager_recall, tmp_path, reread):
    settings = config(head_gate_file, recall=True, temperature=0.9, reread=reread)
    prompt = [tiny.bos_id] + tiny.encode("x y z the key is 42 and more words follow here now")

    def fresh():
        return Brain.start(tiny, prompt, settings, pins=["42"])

    straight = fresh()
    expected = [straight.step().token_id for _ in range(40)]
    brain = fresh()
    got = [brain.step().token_id for _ in range(23)]
    sessions.save(tmp_path / "s", brain, tiny.name)
    resumed = sessions.resume(tiny, tmp_path / "s")
    assert layer_positions(resumed.state) == layer_positions(brain.state)
    assert resumed.policy.state().keys() == brain.policy.state().keys() >= {"recall", "pinned"}
    got += [resumed.step().token_id for _ in range(17)]
    assert got == expected
    assert straight.policy.recall.restored > 0


def in_blocks_of_four(lm, gate_file, monkeypatch, *, seed: int, ticks: int, first: int):
    """Sessions whose index goes to blob files in blocks of 4 slots: the tokens of `ticks`
    uninterrupted ticks, and of the `first` of them by another brain (to be saved), with both
    brains (that one, the uninterrupted one)."""
    monkeypatch.setattr(sessions, "BLOB_MIN", 1)
    monkeypatch.setattr(lane_recall, "BLOCK", 4)
    settings = config(gate_file, recall=True, temperature=0.9)
    prompt = text_ids(lm, 25, seed=seed)
    straight = Brain.start(lm, prompt, settings)
    expected = [straight.step().token_id for _ in range(ticks)]
    brain = Brain.start(lm, prompt, settings)
    return expected, [brain.step().token_id for _ in range(first)], brain, straight


def test_a_checkpoint_writes_only_the_index_blocks_that_changed(tiny, head_gate_file, eager_recall, tmp_path,
                                                                 monkeypatch):
    """The index goes to blob files, a block of the ring each (keys, values), named by their
    content: the next checkpoint writes the blocks new tokens fell in, keeps the others' files as
    they are and removes the ones no longer named; the session resumed from it goes on exactly."""
    expected, got, brain, _ = in_blocks_of_four(tiny, head_gate_file, monkeypatch, seed=38, ticks=40, first=21)
    path = tmp_path / "s"
    sessions.save(path, brain, tiny.name)

    def blobs():
        return {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in path.glob("blob-*.bin")}
    first, indexed = blobs(), len(brain.policy.recall.ids)
    assert indexed % 4 and len(first) == 2 * -(-indexed // 4) >= 6, "keys and values, a block each, the last part full"
    assert (path / sessions.MIRROR_FILE).stat().st_size < sum((path / name).stat().st_size for name in first)
    got += [brain.step().token_id for _ in range(4)]
    sessions.save(path, brain, tiny.name)
    second = blobs()
    kept = first.keys() & second.keys()
    assert {name: first[name] for name in kept} == {name: second[name] for name in kept}, "not written again"
    assert len(kept) == 2 * (indexed // 4), "every full block's files stay; the part-full block's are replaced"
    assert len(second) == 2 * -(-len(brain.policy.recall.ids) // 4)
    resumed = sessions.resume(tiny, path)
    got += [resumed.step().token_id for _ in range(15)]
    assert got == expected


def test_a_session_whose_index_ring_wrapped_resumes_exactly(tiny, head_gate_file, eager_recall, tmp_path,
                                                            monkeypatch):
    """An index of 12 tokens that has wrapped round its ring (the oldest overwritten; the
    prompt's bulk prune alone sent more tokens than that) is saved in blocks of 4 slots and
    resumed slot for slot: the resumed run goes on token for token."""
    made = lane_recall.LaneRecall.__init__
    monkeypatch.setattr(lane_recall.LaneRecall, "__init__",
                        lambda self, heads, **kw: made(self, heads, **kw | {"capacity": 12}))
    expected, got, brain, straight = in_blocks_of_four(tiny, head_gate_file, monkeypatch, seed=41, ticks=45, first=27)
    recall = brain.policy.recall
    assert len(recall.ids) == 12 and recall.next not in (0, 4, 8), "wrapped, the newest block part-written"
    sessions.save(tmp_path, brain, tiny.name)
    resumed = sessions.resume(tiny, tmp_path)
    assert (resumed.policy.recall.ids, resumed.policy.recall.next) == (recall.ids, recall.next)
    got += [resumed.step().token_id for _ in range(18)]
    assert got == expected
    assert straight.policy.recall.restored > 0


def test_blobs_this_process_no_longer_remembers_are_written_again(tiny, head_gate_file, tmp_path, monkeypatch):
    """What a save remembers of the blobs it wrote is bounded (a server sees sessions come and
    go); a blob it forgot is written again, not trusted unseen, and the session stays whole."""
    monkeypatch.setattr(sessions, "BLOB_MIN", 1)
    monkeypatch.setattr(lane_recall, "BLOCK", 4)
    monkeypatch.setattr(sessions, "WRITTEN_KEPT", 2)
    brain = Brain.start(tiny, text_ids(tiny, 25, seed=40), config(head_gate_file, recall=True))
    for _ in range(14):
        brain.step()
    sessions.save(tmp_path, brain, tiny.name)
    first = {f.name: f.stat().st_ino for f in tmp_path.glob("blob-*.bin")}
    assert len(first) > 4 and len(sessions._written) == 2
    sessions.save(tmp_path, brain, tiny.name)
    again = {f.name: f.stat().st_ino for f in tmp_path.glob("blob-*.bin")}
    assert again.keys() == first.keys()
    # each write forgets the oldest remembered: with 2 remembered of 16, none is left when reached
    assert all(again[name] != first[name] for name in first) and len(sessions._written) == 2
    assert sessions.resume(tiny, tmp_path).tick == brain.tick


@pytest.mark.parametrize("damage, message", [
    (lambda blob: blob.write_bytes(blob.read_bytes()[:-1] + b"\x00"), "checksum mismatch"),
    (lambda blob: blob.unlink(), "cannot read a piece of the saved policy state"),
])
def test_a_damaged_or_missing_index_block_is_refused_by_name(tiny, head_gate_file, tmp_path, monkeypatch, damage,
                                                              message):
    monkeypatch.setattr(sessions, "BLOB_MIN", 1)
    brain = Brain.start(tiny, text_ids(tiny, 25, seed=39), config(head_gate_file, recall=True))
    for _ in range(12):
        brain.step()
    sessions.save(tmp_path, brain, tiny.name)
    blob = sorted(tmp_path.glob("blob-*.bin"))[0]
    damage(blob)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(sessions.SessionError, match=message) as caught:
        sessions.resume(tiny, tmp_path)
    assert blob.name in str(caught.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files, "a failed resume changes nothing"


def test_a_pinned_token_stays_in_every_lane(tiny, head_gate_file):
    prompt = [tiny.bos_id] + tiny.encode("a b c the secret is 7 then d e f g")
    brain = Brain.start(tiny, prompt, config(head_gate_file), pins=["secret"])
    pinned = [i for i in brain.state.mirror.live.ledger_ids if brain.state.mirror.ledger[i].pinned]
    assert pinned
    for token in text_ids(tiny, 60, seed=33)[1:]:
        record = brain.step(force=token)
        assert not record.rebuilt and record.live_length <= BUDGET
    rows = brain.state.mirror.layers.rows
    assert all(set(pinned) <= set(lane) for lane in rows), "every lane keeps the pinned tokens"
    assert brain.policy.memory.size == brain.policy.size - len(pinned)
    brain.state.check(deep=True)


def test_only_a_token_every_lane_holds_can_be_pinned_and_an_unpinned_one_competes_again(tiny, head_gate_file):
    brain = Brain.start(tiny, text_ids(tiny, 15, seed=34), config(head_gate_file))
    for token in text_ids(tiny, 40, seed=35)[1:]:
        brain.step(force=token)
    state = brain.state
    lanes, live = state.lanes, state.mirror.live.ledger_ids
    counts = state.mirror.layers.counts
    partial = next(row for row, i in enumerate(live) if counts[i] < lanes)
    before = to_bytes(state.mirror)
    with pytest.raises(ValueError, match="held by some lanes only"):
        state.pin([partial])
    assert to_bytes(state.mirror) == before
    everywhere = next(row for row, i in enumerate(live)
                      if counts[i] == lanes and row >= brain.policy.keep and i <= brain.policy.offered)
    state.pin([everywhere])
    brain.step(force=5)
    assert brain.policy.memory.size == brain.policy.size - 1 and len(brain.policy.pinned_out) == 1
    state.unpin([state.mirror.live.ledger_ids.index(live[everywhere])])
    brain.step(force=6)
    assert brain.policy.memory.size == brain.policy.size and not brain.policy.pinned_out
    state.check(deep=True)


def test_a_restore_into_a_lane_that_holds_the_token_is_refused(tiny, head_gate_file):
    brain = Brain.start(tiny, text_ids(tiny, 30, seed=36), config(head_gate_file))
    state = brain.state
    held = state.mirror.live.ledger_ids[-2]  # in the window: every lane holds it
    keys, values = state.view(keys=True).rows.layer_rows([held])
    before = to_bytes(state.mirror)
    restore = {"action": "restore", "ledger_ids": [held], "lanes": [[0]], "keys": keys, "values": values,
               "predicted": [1]}
    with pytest.raises(ValueError, match="already held"):
        state.apply([{"action": "drop", "rows": [[4, 5]] + [[4]] * (state.lanes - 1)}, restore])
    with pytest.raises(ActionError, match="end with as many rows"):
        state.apply([restore])
    assert to_bytes(state.mirror) == before
    state.check(deep=True)


def test_past_the_position_limit_recall_starts_its_index_again(tiny, head_gate_file, eager_recall):
    """Packing moves the live positions down; indexed keys are rotated at the old ones, so the
    index is emptied and every restore after it still passes layer 0's check."""
    brain = Brain.start(tiny, text_ids(tiny, 20, seed=37), config(head_gate_file, recall=True))
    restored_before_packing = None
    for token in text_ids(tiny, tiny.max_positions + 60, seed=38)[1:]:
        record = brain.step(force=token)
        assert not record.rebuilt, record.error
        if restored_before_packing is None and max(brain.state.positions()) < brain.tick:
            restored_before_packing = brain.policy.recall.restored
    assert max(brain.state.positions()) < tiny.max_positions < brain.tick
    assert brain.policy.recall.restored > restored_before_packing > 0, "recall works before and after packing"
    brain.state.check(deep=True)


def test_a_tokens_kv_is_read_from_its_own_row_in_every_lane(tiny, head_gate_file):
    """RowReader.layer_rows: a token every lane holds at different rows (an old one), one at
    the same row in every lane (the window's edge: one search, checked), both at once: each
    lane's K/V come from its own row; a token some lane lacks is refused."""
    brain = Brain.start(tiny, text_ids(tiny, 24, seed=37), config(head_gate_file))
    for token in text_ids(tiny, 30, seed=38)[1:]:
        brain.step(force=token)
    state = brain.state
    live = state.mirror.live.ledger_ids
    lanes = [[live[row] for row in state.mirror.layer_rows_of(lane)] for lane in range(state.lanes)]  # ledger ids
    common = set(lanes[0]).intersection(*lanes[1:])
    apart = [i for i in sorted(common) if len({ids.index(i) for ids in lanes}) > 1]
    edge = state.mirror.live.ledger_ids[-2]
    assert apart and len({ids.index(edge) for ids in lanes}) == 1
    heads = state.lanes // tiny.num_layers
    for wanted in ([apart[0]], [edge], [apart[0], edge]):
        keys, values = state.view(keys=True).rows.layer_rows(wanted)
        for lane, ids in enumerate(lanes):
            layer, head = divmod(lane, heads)
            cache_keys, cache_values = state.layer_kv(layer)
            rows = [ids.index(i) for i in wanted]
            assert torch.equal(keys[layer, head], cache_keys[0, head, rows].float())
            assert torch.equal(values[layer, head], cache_values[0, head, rows].float())
    lacking = next(i for i in sorted(set().union(*lanes)) if i not in common)
    with pytest.raises(ValueError, match="does not hold"):
        state.view(keys=True).rows.layer_rows([lacking])


def test_every_lanes_ids_and_keys_come_in_its_own_row_order(tiny, head_gate_file):
    """RowReader.lane_ids / lane_keys / lane_scores: row i of lane l's keys is the key of
    lane_ids()[l][i], the same as the state's own per-layer K/V, and its score is the query's
    product with that key; all copies or new tensors, refused once the state moved on."""
    brain = Brain.start(tiny, text_ids(tiny, 24, seed=39), config(head_gate_file))
    for token in text_ids(tiny, 30, seed=40)[1:]:
        brain.step(force=token)
    state = brain.state
    view = state.view(keys=True)
    ids, keys = view.rows.lane_ids(), view.rows.lane_keys()
    assert ids == state.mirror.layers.rows and len({tuple(lane) for lane in ids}) > 1, "lanes hold different rows"
    heads = state.lanes // tiny.num_layers
    assert keys.shape[:3] == (tiny.num_layers, heads, len(ids[0])) and keys.dtype == torch.float32
    for layer in range(tiny.num_layers):
        assert torch.equal(keys[layer], state.layer_kv(layer)[0][0].float())
    query = torch.randn(tiny.num_layers, view.query.shape[1], keys.shape[-1], generator=torch.Generator().manual_seed(0))
    scores = view.rows.lane_scores(query)  # [layers, kv_heads, group, rows], against the keys in place
    torch.testing.assert_close(scores, query.reshape(tiny.num_layers, heads, -1, keys.shape[-1]) @ keys.transpose(-1, -2))
    with pytest.raises(ValueError, match="a query of every layer"):
        view.rows.lane_scores(query[:1])
    keys.zero_(), scores.zero_(), ids[0].clear()
    assert view.rows.lane_ids() == state.mirror.layers.rows and view.rows.lane_keys().abs().sum() > 0
    brain.step(force=tiny.bos_id)
    with pytest.raises(ValueError, match="stale"):
        view.rows.lane_keys()


@pytest.mark.parametrize("name", ["int4", "fp4", "int4h"])
def test_smartkv_with_recall_on_4bit_rows_checks_rebuilds_and_resumes_exactly(tiny, head_gate_file, eager_recall,
                                                                              tmp_path, name):
    """Each kv head keeps its own rows in a 4-bit format: tokens come back into some lanes
    (encoded there alone), layer 0 stays within the format's bound of a fresh computation (each
    lane's keys read at its own rows' positions), a fault rebuilds the lanes from the mirror,
    and a saved session resumes with the same codes and goes on with the same tokens. A pinned
    token stays in every lane."""
    ids = text_ids(tiny, 100, seed=31)
    brain = Brain.start(tiny, ids[:15], config(head_gate_file, recall=True, kv_format=name, seed=4))
    brain.state.pin([5])
    pinned = brain.state.mirror.live.ledger_ids[5]
    restores = []
    for n in range(15, 70):
        record = brain.step(force=ids[n])
        assert not record.rebuilt, record.error
        assert record.live_length <= BUDGET
        restores += [a for a in record.actions if a["action"] == "restore"]
        if n % 10 == 0:
            brain.state.check(deep=True)
    assert brain.state.cache.kv_format == name
    shape = dict(layers=tiny.num_layers, kv_heads=tiny.num_kv_heads, head_dim=tiny.head_dim, dtype=tiny.dtype)
    assert brain.state.bytes_per_token() == bytes_per_token(name, lanes=brain.state.lanes, **shape)
    assert any(len(taking) < brain.state.lanes for action in restores for taking in action["lanes"]), \
        "some token should come back into some lanes only"
    assert all(pinned in lane for lane in brain.state.mirror.layers.rows), "every lane keeps the pinned token"
    brain.state.inject_fault("forward")
    assert brain.step(force=ids[70]).rebuilt
    brain.state.check(deep=True)
    for token in ids[70:80]:
        assert not brain.step(force=token).rebuilt
    brain.state.check(deep=True)
    sessions.save(tmp_path, brain, tiny.name)
    resumed = sessions.resume(tiny, tmp_path)
    assert resumed.state.kv_format == name and resumed.state.per_layer
    for a, b in zip(brain.state.cache.layers, resumed.state.cache.layers):
        assert torch.equal(a.codes.keys, b.codes.keys) and torch.equal(a.scales.values, b.scales.values)
    assert [brain.step(force=t).token_id for t in ids[80:]] == [resumed.step(force=t).token_id for t in ids[80:]]
    assert [brain.step().token_id for _ in range(8)] == [resumed.step().token_id for _ in range(8)]
