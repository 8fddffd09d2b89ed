"""Recall (positronic/recall.py) and the `restore` action it drives: evicted rows come back
exactly where they were, when the newest query wants them."""

import dataclasses
import math
import random

import pytest
import torch

from positronic.actions import ActionError
from positronic.forward import fresh_layer0_kv
from positronic.loop import Brain, BrainConfig
from positronic.recall import Recall
from positronic.state_manager import StateManager


def culled(tiny, rows, length=40, seed=3):
    rng = random.Random(seed)
    sm = StateManager.from_tokens(tiny, [rng.randrange(3, 512) for _ in range(length)])
    before = list(zip(sm.live_token_ids(), sm.positions()))
    sm.apply([{"action": "delete", "position": r} for r in rows] + [{"action": "add", "token_id": 7}], tick=1)
    return sm, before


def test_restored_rows_come_back_at_their_positions_with_their_ledger_entries(tiny):
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
    fresh, _ = fresh_layer0_kv(tiny, [t for t, _ in before[:7]], list(range(7)))
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
    recall = Recall(threshold=8.0, span=5, cooldown=5)
    recall.choose(view)
    evicted = [10, 11, 12, 13, 14, 30]
    recall.plan(view, evicted, [])
    sm.apply([{"action": "delete", "position": r} for r in evicted] + [{"action": "add", "token_id": 8}])
    recall.commit()
    assert recall.ids == [int(view.ledger_ids[r]) for r in evicted]
    # a query that matches row 12's key on every head (and a live context that does not)
    key = view.keys[:, :, 12]  # [layers, kv_heads, d]
    group = view.query.shape[1] // key.shape[1]
    query = key.repeat_interleave(group, dim=1) * 4.0
    later = dataclasses.replace(sm.view(keys=True), query=query, log_norm=torch.zeros_like(view.log_norm))
    chosen = recall.choose(later)
    assert chosen[0] == int(view.ledger_ids[12]) and set(chosen) <= {int(view.ledger_ids[r]) for r in (10, 11, 12, 13, 14)}
    assert len(chosen) == 5, "up to span rows around the match, not row 30 (18 positions away)"
    # a query that scores every row alike: an evicted row would get a live row's share
    quiet = dataclasses.replace(later, query=query * 0.0, log_norm=torch.full_like(view.log_norm, math.log(len(later))))
    assert recall.choose(quiet) == [], "no match above the threshold: nothing comes back"
    recall.plan(later, [], chosen)
    recall.discard()
    assert len(recall) == 6, "a tick that did not happen changes nothing"
    recall.choose(later)
    recall.plan(later, [], chosen)
    recall.commit()
    assert recall.ids == [int(view.ledger_ids[30])] and recall.restored == 5


def test_recall_keeps_the_budget_and_its_state_resumes_exactly(tiny, tmp_path):
    from positronic import session as sessions
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
    a = [(r.token_id, r.actions) for r in (brain.step() for _ in range(40))]
    b = [(r.token_id, r.actions) for r in (resumed.step() for _ in range(40))]
    assert a == b
