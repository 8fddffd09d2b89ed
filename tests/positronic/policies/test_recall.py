"""Recall (positronic/policies/recall.py) and the `restore` action it drives: evicted rows come back
exactly where they were, when the newest query wants them."""

import dataclasses
import math
import random

import pytest
import torch

from positronic.state.actions import ActionError, loggable
from positronic.brain.loop import Brain, BrainConfig
from positronic.policies.recall import Lookup, Recall
from positronic.state.manager import StateManager


def culled(tiny, rows, length=40, seed=3):
    rng = random.Random(seed)
    sm = StateManager.from_tokens(tiny, [rng.randrange(3, 512) for _ in range(length)], score_layers="all")
    before = list(zip(sm.live_token_ids(), sm.positions()))
    sm.apply([{"action": "delete", "position": r} for r in rows] + [{"action": "add", "token_id": 7}], tick=1)
    return sm, before


def test_restored_rows_come_back_at_their_positions_with_their_ledger_entries(tiny, layer0_oracle):
    sm, before = culled(tiny, [5, 6, 7, 20])
    ids = [i for i, e in enumerate(sm.mirror.ledger.entries) if e.state == "culled"]
    assert ids == [5, 6, 7, 20] and [sm.mirror.ledger[i].position for i in ids] == [5, 6, 7, 20]
    report = sm.apply([{"action": "restore", "ledger_ids": [20, 6, 5]}, {"action": "add", "token_id": 9}], tick=2)
    assert not report.rebuilt
    assert list(zip(sm.live_token_ids(), sm.positions()))[:-2] == [b for k, b in enumerate(before) if k != 7]
    entries = sm.mirror.ledger.entries
    assert [(entries[i].state, entries[i].resurrections, entries[i].position) for i in (5, 6, 7, 20)] == [
        ("live", 1, None), ("live", 1, None), ("culled", 0, 7), ("live", 1, None)]
    sm.check(deep=True)  # layer 0 of every row equals a fresh computation at the recorded positions
    keys, _ = sm.layer_kv(0)
    fresh, _ = layer0_oracle(tiny, [t for t, _ in before[:7]], list(range(7)))
    torch.testing.assert_close(keys[:, :, :7], fresh, rtol=0, atol=1e-5)


@pytest.mark.parametrize("actions, message", [
    ([{"action": "restore", "ledger_ids": [3]}], r"ledger id 3 cannot come back \(live, no position\)"),
    ([{"action": "restore", "ledger_ids": [999]}], "ledger id 999 cannot come back .no ledger entry"),
    ([{"action": "restore", "ledger_ids": []}], "ledger_ids must be a non-empty list"),
    ([{"action": "restore", "ledger_ids": [5, True]}], "ledger_ids must be a non-empty list"),
    ([{"action": "restore", "ledger_ids": [5]}, {"action": "restore", "ledger_ids": [5]}],
     "ledger id 5 is already restored by action 0"),
])
def test_a_bad_restore_is_refused_and_changes_nothing(tiny, actions, message):
    sm, _ = culled(tiny, [5, 6])
    state = (sm.live_token_ids(), sm.positions(), [dataclasses.astuple(e) for e in sm.mirror.ledger.entries])
    with pytest.raises(ActionError, match=message):
        sm.apply(actions + [{"action": "add", "token_id": 4}])
    assert state == (sm.live_token_ids(), sm.positions(), [dataclasses.astuple(e) for e in sm.mirror.ledger.entries])


def test_a_position_a_live_row_moved_into_cannot_be_restored(tiny):
    sm, _ = culled(tiny, [6])
    # three tokens for the pair (4, 5): the rows after them shift right, into position 6
    sm.apply([{"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": [11, 12, 13]}])
    assert 6 in sm.positions()
    with pytest.raises(ActionError, match="position 6 is held by a live row"):
        sm.apply([{"action": "restore", "ledger_ids": [6]}])


def test_recall_brings_back_the_evicted_rows_the_query_matches_and_nothing_else(tiny):
    sm, _ = culled(tiny, [])
    view = sm.view(keys=True)
    before_keys = torch.stack([layer.keys[0] for layer in sm.cache.layers])
    recall = Recall(threshold=8.0, span=5, cooldown=5, every=1)
    lookup = recall.look(view)
    evicted = [10, 11, 12, 13, 14, 30]
    recall.settle(lookup, view, evicted, [], [])
    sm.apply([{"action": "delete", "position": r} for r in evicted] + [{"action": "add", "token_id": 8}])
    recall.adopt(lookup)
    assert recall.ids == [int(view.ledger_ids[r]) for r in evicted]
    # a query that matches row 12's key on every head (and a live context that does not)
    key = recall.keys[:, :, 2].float()  # row 12's keys as it was evicted: [layers, kv_heads, d]
    torch.testing.assert_close(key, before_keys[:, :, 12], rtol=0, atol=0)
    group = view.query.shape[1] // key.shape[1]
    query = key.repeat_interleave(group, dim=1) * 4.0
    later = dataclasses.replace(sm.view(keys=True), query=query, log_norm=torch.zeros_like(view.log_norm))
    chosen = recall.look(later).back
    assert chosen[0] == int(view.ledger_ids[12]) and set(chosen) <= {int(view.ledger_ids[r]) for r in (10, 11, 12, 13, 14)}
    assert len(chosen) == 5, "up to span rows around the match, not row 30 (18 positions away)"
    # a query that scores every row alike: an evicted row would get a live row's share
    quiet = dataclasses.replace(later, query=query * 0.0, log_norm=torch.full_like(view.log_norm, math.log(len(later))))
    assert recall.look(quiet).back == [], "no match above the threshold: nothing comes back"
    lookup, actions, outcomes = recall.look(later), [], []
    recall.settle(lookup, later, [], actions, outcomes)
    assert [a["action"] for a in actions] == ["restore"] and actions[0]["ledger_ids"] == chosen
    assert len(recall) == 6, "a tick that did not happen (its lookup never adopted) changes nothing"
    lookup = recall.look(later)
    recall.settle(lookup, later, [], [], [])
    recall.adopt(lookup)
    assert recall.ids == [int(view.ledger_ids[30])] and recall.restored == 5


def test_recall_keeps_the_budget_and_its_state_resumes_exactly(tiny, tmp_path):
    from positronic.brain import session as sessions
    config = BrainConfig(budget=48, recall=True, seed=4)
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), config)
    brain.policy.recall.threshold = 1.0  # a random model attends about evenly: make recall fire
    records = [brain.step() for _ in range(80)]
    assert max(r.live_length for r in records) <= 48
    assert brain.policy.recall.restored > 0 and any(a["action"] == "restore" for r in records for a in r.actions)
    brain.state.check(deep=True)
    ledger = brain.state.mirror.ledger
    assert sum(e.resurrections for e in ledger.entries) == brain.policy.recall.restored
    sessions.save(tmp_path, brain, tiny.name)
    resumed = sessions.resume(tiny, tmp_path)
    resumed.policy.recall.threshold = 1.0
    assert resumed.policy.recall.ids == brain.policy.recall.ids
    a = [brain.step() for _ in range(40)]
    b = [resumed.step() for _ in range(40)]
    assert [(r.token_id, [loggable(x) for x in r.actions]) for r in a] == \
        [(r.token_id, [loggable(x) for x in r.actions]) for r in b]
    restores = [(x, y) for r, s in zip(a, b) for x, y in zip(r.actions, s.actions) if x["action"] == "restore"]
    assert restores and all(torch.equal(x["keys"], y["keys"]) and torch.equal(x["values"], y["values"])
                            for x, y in restores), "the resumed index hands back the same K/V"


def kv_rows(sm, rows):
    """Every layer's K/V of live rows: [layers, kv_heads, len(rows), head_dim] each."""
    return (torch.stack([layer.keys[0, :, rows] for layer in sm.cache.layers]),
            torch.stack([layer.values[0, :, rows] for layer in sm.cache.layers]))


def test_a_restore_with_stored_kv_puts_back_exactly_the_rows_that_were_evicted(tiny):
    sm, _ = culled(tiny, [])
    view = sm.view(keys=True)
    keys, values = view.rows([5, 6, 20])
    torch.testing.assert_close((keys, values), kv_rows(sm, [5, 6, 20]), rtol=0, atol=0)
    predicted = [int(view.predicted[r]) for r in (5, 6, 20)]
    sm.apply([{"action": "delete", "position": r} for r in (5, 6, 20)] + [{"action": "add", "token_id": 7}], tick=1)
    with pytest.raises(ValueError, match="stale"):
        view.rows([1])
    # the rows come back in another order than they left; the K/V follow their ledger ids
    order = [2, 0, 1]
    sm.apply([{"action": "restore", "ledger_ids": [[5, 6, 20][k] for k in order], "keys": keys[:, :, order],
               "values": values[:, :, order], "predicted": [predicted[k] for k in order]},
              {"action": "add", "token_id": 9}], tick=2)
    rows = [sm.mirror.live.ledger_ids.index(i) for i in (5, 6, 20)]
    assert rows == [5, 6, 20]
    torch.testing.assert_close(kv_rows(sm, rows), (keys, values), rtol=0, atol=0)
    assert [int(sm.view().predicted[r]) for r in rows] == predicted
    sm.check(deep=True)
    # deeper layers are the evicted rows' own, not a recomputation with today's left context
    # (rows 2 and 3 stay out: a recomputed row 5 would see another left context than it had)
    recomputed, _ = culled(tiny, [2, 3, 5, 6, 20])
    recomputed.apply([{"action": "restore", "ledger_ids": [5, 6, 20]}, {"action": "add", "token_id": 9}], tick=2)
    again = kv_rows(recomputed, [recomputed.mirror.live.ledger_ids.index(i) for i in (5, 6, 20)])
    torch.testing.assert_close(again[0][0], keys[0], rtol=0, atol=1e-5)  # layer 0: token and position only
    assert (again[0][-1] - keys[-1]).abs().max() > 1e-3, "the last layer's recomputed keys see today's context"


@pytest.mark.parametrize("change, message", [
    (lambda k, v, p: (k[:, :, [1, 0]], v[:, :, [1, 0]], p), "differ from the tokens' own at their positions in layer 0"),
    (lambda k, v, p: (k[:1], v[:1], p), r"K/V are \(1, "),
    (lambda k, v, p: (k, v[:, :, :1], p), "values must be a tensor"),
    (lambda k, v, p: (k * float("nan"), v, p), "keys must be finite"),
    (lambda k, v, p: (k, v, p[:1]), "predicted must be 2 token ids"),
    (lambda k, v, p: (k, v, None), "predicted must be"),
])
def test_a_restore_with_bad_kv_is_refused_and_changes_nothing(tiny, change, message):
    sm, _ = culled(tiny, [])
    view = sm.view(keys=True)
    keys, values = view.rows([5, 9])
    predicted = [int(view.predicted[r]) for r in (5, 9)]
    sm.apply([{"action": "delete", "position": r} for r in (5, 9)] + [{"action": "add", "token_id": 7}], tick=1)
    state = (sm.live_token_ids(), sm.positions(), [dataclasses.astuple(e) for e in sm.mirror.ledger.entries],
             kv_rows(sm, list(range(len(sm)))))
    k, v, p = change(keys, values, predicted)
    action = {"action": "restore", "ledger_ids": [5, 9], "keys": k, "values": v, "predicted": p}
    with pytest.raises(ActionError, match=message):
        sm.apply([action, {"action": "add", "token_id": 4}])
    after = (sm.live_token_ids(), sm.positions(), [dataclasses.astuple(e) for e in sm.mirror.ledger.entries],
             kv_rows(sm, list(range(len(sm)))))
    assert state[:3] == after[:3] and all(torch.equal(x, y) for x, y in zip(state[3], after[3]))
    with pytest.raises(ActionError, match="keys, values and predicted come together"):
        sm.apply([{"action": "restore", "ledger_ids": [5, 9], "keys": keys}, {"action": "add", "token_id": 4}])


def test_recall_looks_every_few_ticks_and_at_once_after_typed_input(tiny):
    sm, _ = culled(tiny, [])
    view = sm.view(keys=True)
    recall = Recall(threshold=8.0, span=3, every=4)
    lookup = recall.look(view)
    recall.settle(lookup, view, [12], [], [])
    sm.apply([{"action": "delete", "position": 12}, {"action": "add", "token_id": 8}])
    recall.adopt(lookup)
    query = recall.keys[:, :, 0].float().repeat_interleave(view.query.shape[1] // recall.keys.shape[1], dim=1) * 4
    matching = dataclasses.replace(sm.view(keys=True), query=query, log_norm=torch.zeros_like(view.log_norm))

    def looked(typed=False):
        """One tick's look; the tick goes through without bringing anything back (the clock moves on)."""
        lookup = recall.look(matching, typed=typed)
        found = lookup.back
        lookup.fit(0)
        recall.adopt(lookup)
        return found

    looks = [bool(looked()) for _ in range(8)]  # plans 2..9 (the first was plan 1)
    assert looks == [False, False, True, False, False, False, True, False], "a look at plans 4 and 8"
    recall.wake()
    assert looked() == [int(view.ledger_ids[12])], "typed input: the next plan looks off schedule"
    assert looked() == [], "and then the schedule again"
    assert looked() == [int(view.ledger_ids[12])], "plan 12: on schedule"
    assert looked(typed=True) == [] and recall.awake, "a tick that adds a typed token wakes recall as it commits"
    assert looked() == [int(view.ledger_ids[12])] and looked() == []
    recall.look(matching, typed=True)
    assert not recall.awake, "not before"


def test_restores_go_into_the_event_log_as_ids_and_the_shape_of_their_kv(tiny):
    import json
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48, recall=True, seed=4))
    brain.policy.recall.threshold, brain.policy.recall.every = 1.0, 1
    records = [brain.step() for _ in range(40)]
    logged = [a for r in records for a in json.loads(json.dumps(r.to_json()))["actions"] if a["action"] == "restore"]
    assert logged and all(a["stored"] == [tiny.num_layers, tiny.num_kv_heads, len(a["ledger_ids"]), tiny.head_dim]
                          for a in logged)


def test_evictions_go_into_room_after_the_kept_rows_not_into_a_copy_of_the_index():
    """Each tick's evicted rows are written after the kept ones; the index is copied only when
    that room runs out (capacity 8: room for 24 rows), and the oldest rows go first all along;
    rows a restore takes out of the middle leave exactly, the rest moved down in the same buffers."""
    generator = torch.Generator().manual_seed(5)
    recall = Recall(capacity=8)
    given_keys, given_values, storages, offsets = [], [], set(), []
    for tick in range(12):
        keys, values = (torch.randn(2, 1, 3, 4, generator=generator) for _ in range(2))
        given_keys.append(keys), given_values.append(values)
        lookup = Lookup(tick + 1, False)
        lookup.evicted = (list(range(3 * tick, 3 * tick + 3)), [100 + 3 * tick + k for k in range(3)], [0, 0, 0],
                          keys, values)
        recall.adopt(lookup)
        storages.add(recall.keys.untyped_storage().data_ptr())
        offsets.append(recall.keys.storage_offset())
        assert recall.ids == list(range(max(0, 3 * tick + 3 - 8), 3 * tick + 3))
        assert torch.equal(recall.keys, torch.cat(given_keys, dim=2)[:, :, -8:])
        assert torch.equal(recall.values, torch.cat(given_values, dim=2)[:, :, -8:])
    assert len(storages) <= 3, "36 rows in 12 ticks: a copy every ~16 rows, not every tick"
    assert max(offsets) > 0, "the oldest rows leave by moving where the kept ones start, not by a copy"
    lookup = Lookup(13, False)
    lookup.back = [30, 33]
    expected = [k for k, i in enumerate(recall.ids) if i not in (30, 33)]
    before_keys, storage = recall.keys.clone(), recall.keys.untyped_storage().data_ptr()
    recall.adopt(lookup)
    assert recall.ids == [28, 29, 31, 32, 34, 35] and torch.equal(recall.keys, before_keys[:, :, expected])
    assert recall.keys.untyped_storage().data_ptr() == storage, "compacted in place: the room stays"


def test_a_session_saved_before_recall_kept_values_resumes_with_an_empty_index():
    old = {"ids": [4, 5], "positions": [4, 5], "shape": [2, 1, 1, 2], "keys": bytes(32), "back_at": [[3, 1]],
           "clock": 17, "restored": 6}
    recall = Recall()
    recall.load_state(old)
    assert (len(recall), recall.clock, recall.restored, recall.keys) == (0, 17, 6, None)
    with pytest.raises(ValueError, match="malformed"):
        recall.load_state({**old, "extra": 1})


def test_a_tick_that_restores_rows_with_their_kv_is_captured_and_replays(tiny, tmp_path):
    from positronic.fixtures import capture_tick, load_fixture, replay, save_fixture
    sm, _ = culled(tiny, [])
    view = sm.view(keys=True)
    keys, values = view.rows([5, 6])
    predicted = [int(view.predicted[r]) for r in (5, 6)]
    sm.apply([{"action": "delete", "position": 5}, {"action": "delete", "position": 6}, {"action": "add", "token_id": 7}])
    fixture, report = capture_tick(sm, [{"action": "restore", "ledger_ids": [5, 6], "keys": keys, "values": values,
                                         "predicted": predicted}, {"action": "add", "token_id": 9}])
    save_fixture(fixture, tmp_path / "restore.pt")
    result = replay(load_fixture(tmp_path / "restore.pt"), tiny)
    assert not report.rebuilt and all(check.passed for check in result.checks), result.checks
    assert result.greedy == fixture.expected.greedy


@pytest.mark.parametrize("kv_format", ["int4", "fp4"])
def test_recall_restores_rows_into_a_packed_cache(tiny, kv_format):
    """A restore's K/V go into a 4-bit cache encoded like any other row (not into a decoded
    copy that is thrown away): the deep check holds after many restores."""
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)),
                        BrainConfig(budget=48, recall=True, seed=4, kv_format=kv_format))
    brain.policy.recall.threshold = 1.0
    restores = 0
    for _ in range(60):
        record = brain.step()
        if any(a["action"] == "restore" for a in record.actions):
            restores += 1
            brain.state.check(deep=True)  # right after the restore, before the rows can leave again
    assert restores > 0
