"""Core v4's state (positronic/state/slots.py): many sequences' rows in one set of tensors,
edited a round at a time, equal to the single-sequence state and to themselves alone."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from positronic.state.actions import ActionError
from positronic.state.edit import Bounds, Edit
from positronic.state.manager import StateManager
from positronic.state.slots import SlotState

CAPACITY = 72


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def deletions(rng: random.Random, length: int) -> list[int]:
    """Some rows of `length` (never the last: a round keeps the newest row's context)."""
    if length < 12 or rng.random() < 0.5:
        return []
    return sorted(rng.sample(range(1, length - 1), rng.randint(1, 4)))


def round_of(state: SlotState, edits: list[list[int]], tokens: list[int]):
    deleted = torch.zeros((state.active, state.capacity), dtype=torch.bool)
    for slot, rows in enumerate(edits):
        deleted[slot, rows] = True
    return state.apply(deleted, tokens)


def test_a_slot_ticks_as_the_single_sequence_state_does(tiny):
    """Deletes and an add a round, 40 rounds: the same live tokens, positions and next tokens
    as a StateManager given the same edits; logits within float rounding (the slot attends over
    its whole capacity under a mask, the manager over its live rows)."""
    ids = prompt(1, 40)
    reference = StateManager.from_tokens(tiny, ids, capacity=128)
    state = SlotState(tiny, slots=2, capacity=CAPACITY)
    state.join(StateManager.from_tokens(tiny, ids, capacity=128))
    rng = random.Random(5)
    for _ in range(40):
        token = int(reference.next_logits.argmax())
        rows = deletions(rng, len(reference)) if len(reference) > 50 else []
        report = round_of(state, [rows], [token])
        reference.apply([{"action": "delete", "position": row} for row in rows] + [{"action": "add", "token_id": token}])
        assert not report.failed
        assert state.mirror(0).live_token_ids() == reference.mirror.live_token_ids()
        assert state.positions[0, 0, : len(reference)].tolist() == reference.positions()
        assert int(state.length[0]) == len(reference)
        torch.testing.assert_close(state.next_logits[0], reference.next_logits, rtol=0, atol=1e-5)
        assert int(state.next_logits[0].argmax()) == int(reference.next_logits.argmax())
        torch.testing.assert_close(state.shares[0, : len(reference)], reference.last_attention.mean(dim=(0, 1)),
                                   rtol=0, atol=1e-6)
    state.mirror(0).check(tiny.max_positions)


def run(tiny, prompts: list[list[int]], rounds: int, seed: int, *, leave_at: dict[int, int] | None = None):
    """Sequences of `prompts` in one SlotState, `rounds` rounds of random deletes (sequence k's
    drawn from Random(seed * 100 + k)) and greedy adds; sequence k leaves at round leave_at[k].
    Returns each one's logits per round and its last K/V."""
    state = SlotState(tiny, slots=len(prompts), capacity=CAPACITY)
    for ids in prompts:
        state.join(StateManager.from_tokens(tiny, ids, capacity=CAPACITY))
    keys = list(range(len(prompts)))  # which sequence is in which slot
    rngs = {k: random.Random(seed * 100 + k) for k in keys}
    logits = {k: [] for k in keys}
    for number in range(rounds):
        for k, when in (leave_at or {}).items():
            if when == number and k in keys:
                state.leave(keys.index(k))
                last = keys.pop()
                if last != k:
                    keys[keys.index(k)] = last
        if not keys:
            break
        tokens = [int(state.next_logits[slot].argmax()) for slot in range(state.active)]
        lengths = state.length[: state.active].tolist()
        edits = [deletions(rngs[k], lengths[slot]) if lengths[slot] > 50 else [] for slot, k in enumerate(keys)]
        assert not round_of(state, edits, tokens).failed
        for slot, k in enumerate(keys):
            logits[k].append(state.next_logits[slot].clone())
    rows = {k: state.rows(slot) for slot, k in enumerate(keys)}
    return logits, rows


def test_batched_sequences_get_their_alone_numbers_bit_for_bit(tiny):
    """Three sequences of different lengths in one state, one leaving half-way: each one's
    logits every round and its K/V at the end equal those of a state holding it alone."""
    prompts = [prompt(11, 30), prompt(12, 45), prompt(13, 52)]
    together, rows = run(tiny, prompts, 30, seed=3, leave_at={1: 14})
    for k, ids in enumerate(prompts):
        alone, alone_rows = run_one(tiny, ids, 14 if k == 1 else 30, random.Random(3 * 100 + k))
        assert len(together[k]) == len(alone)
        for ours, theirs in zip(together[k], alone):
            assert torch.equal(ours, theirs)
        if k != 1:
            assert torch.equal(rows[k][0], alone_rows[0]) and torch.equal(rows[k][1], alone_rows[1])


def run_one(tiny, ids: list[int], rounds: int, rng: random.Random):
    state = SlotState(tiny, slots=1, capacity=CAPACITY)
    state.join(StateManager.from_tokens(tiny, ids, capacity=CAPACITY))
    logits = []
    for _ in range(rounds):
        length = int(state.length[0])
        assert not round_of(state, [deletions(rng, length) if length > 50 else []],
                            [int(state.next_logits[0].argmax())]).failed
        logits.append(state.next_logits[0].clone())
    return logits, state.rows(0)


def test_every_slot_layer0_equals_a_fresh_prefill_of_its_mirror(tiny, layer0_oracle):
    """After rounds of deletes (gaps in the positions) each sequence's layer-0 K/V are what
    plain transformers computes for its live tokens at their positions."""
    state = SlotState(tiny, slots=3, capacity=CAPACITY)
    for seed in (21, 22, 23):
        state.join(StateManager.from_tokens(tiny, prompt(seed, 55), capacity=CAPACITY))
    rng = random.Random(9)
    for _ in range(12):
        lengths = state.length[: state.active].tolist()
        round_of(state, [deletions(rng, n) for n in lengths],
                 [int(state.next_logits[s].argmax()) for s in range(state.active)])
    for slot in range(state.active):
        mirror = state.mirror(slot)
        keys, values = state.rows(slot)
        expected_keys, expected_values = layer0_oracle(tiny, mirror.live_token_ids(), mirror.positions())
        torch.testing.assert_close(keys[0], expected_keys[0], rtol=0, atol=1e-4)
        torch.testing.assert_close(values[0], expected_values[0], rtol=0, atol=1e-4)


def test_a_failed_round_rebuilds_every_sequence_from_its_unchanged_mirror(tiny, monkeypatch):
    """The forward fails half-way (after the gaps were closed): the report says so, no mirror
    moved, and every sequence's rows are its mirror's again (the next round goes on)."""
    state = SlotState(tiny, slots=2, capacity=CAPACITY)
    for seed in (31, 32):
        state.join(StateManager.from_tokens(tiny, prompt(seed, 56), capacity=CAPACITY))
    before = [state.mirror(s).live_token_ids() for s in range(2)]
    ledgers = [len(state.mirror(s).ledger) for s in range(2)]

    forward, calls = tiny.model.forward, []

    def broken(*args, **kwargs):  # the round's forward fails; the rebuilds' run
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the forward failed")
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny.model, "forward", broken)
    report = round_of(state, [[3, 7], [10]], [5, 6])
    monkeypatch.undo()
    assert len(calls) == 3  # the round, then each sequence's rebuild
    assert report.rebuilt and report.failed == [0, 1] and "the forward failed" in report.error
    assert [state.mirror(s).live_token_ids() for s in range(2)] == before
    assert [len(state.mirror(s).ledger) for s in range(2)] == ledgers
    assert state.length[:2].tolist() == [56, 56]
    assert state.tick(0) == 0
    fresh = StateManager.from_tokens(tiny, before[0], capacity=CAPACITY)
    torch.testing.assert_close(state.next_logits[0], fresh.next_logits, rtol=0, atol=1e-5)
    assert not round_of(state, [[], []], [5, 6]).failed
    assert state.mirror(0).live_token_ids() == before[0] + [5]


def test_a_round_refuses_edits_of_the_wrong_shape_and_changes_nothing(tiny):
    state = SlotState(tiny, slots=2, capacity=CAPACITY)
    state.join(StateManager.from_tokens(tiny, prompt(41, 20), capacity=CAPACITY))
    with pytest.raises(ValueError, match=r"a round of 1 sequences takes deleted \[1, 72\] or \[1, 1, 72\] and 1 tokens"):
        state.apply(torch.zeros((2, CAPACITY), dtype=torch.bool), [1, 2])
    assert state.tick(0) == 0 and len(state.mirror(0)) == 20


def test_joining_refuses_what_does_not_fit(tiny):
    state = SlotState(tiny, slots=1, capacity=CAPACITY)
    with pytest.raises(ValueError, match="73 rows do not fit a slot of 72 rows"):
        state.join(StateManager.from_tokens(tiny, prompt(51, 73), capacity=CAPACITY + 8))
    state.join(StateManager.from_tokens(tiny, prompt(52, CAPACITY), capacity=CAPACITY))
    with pytest.raises(ValueError, match="73 rows after the round do not fit a slot of 72 rows"):
        round_of(state, [[]], [5])
    assert state.tick(0) == 0 and len(state.mirror(0)) == CAPACITY
    with pytest.raises(ValueError, match="all 1 slots are in use"):
        state.join(StateManager.from_tokens(tiny, prompt(53, 10), capacity=CAPACITY))


def test_nan_filled_buffers_are_never_read(tiny, nan_fill):
    """In the NaN-fill mode the slot buffers still start zeroed (masked rows multiply their
    values by 0), and every round's logits are finite."""
    state = SlotState(tiny, slots=2, capacity=CAPACITY)
    state.join(StateManager.from_tokens(tiny, prompt(61, 12), capacity=CAPACITY))
    for _ in range(5):
        round_of(state, [[]], [int(state.next_logits[0].argmax())])
        assert torch.isfinite(state.next_logits[0]).all()


def test_a_round_at_the_position_limit_packs_the_rows_down_as_the_single_state_does(tiny, layer0_oracle):
    """With 80 positions, rounds of deletes go past the limit: the slot packs its rows down to
    0, 1, 2, ... and re-rotates their keys, as a StateManager does; the same tokens follow and
    layer 0 is still a fresh prefill's."""
    import dataclasses

    lm = dataclasses.replace(tiny, max_positions=80)
    ids = prompt(71, 50)
    reference = StateManager.from_tokens(lm, ids, capacity=CAPACITY)
    state = SlotState(lm, slots=2, capacity=CAPACITY)
    state.join(StateManager.from_tokens(lm, prompt(72, 30), capacity=CAPACITY))
    state.join(StateManager.from_tokens(lm, ids, capacity=CAPACITY))
    packed = 0
    for number in range(60):
        token = int(reference.next_logits.argmax())
        rows = [5, 9] if number % 2 else []
        other = int(state.next_logits[0].argmax())
        report = round_of(state, [[2] if number % 2 else [], rows], [other, token])
        reference.apply([{"action": "delete", "position": row} for row in rows] + [{"action": "add", "token_id": token}])
        assert not report.failed
        packed += reference.positions()[0] == 0 and reference.positions()[-1] == len(reference) - 1
        assert state.positions[1, 0, : len(reference)].tolist() == reference.positions()
        assert int(state.next_logits[1].argmax()) == int(reference.next_logits.argmax())
        torch.testing.assert_close(state.next_logits[1], reference.next_logits, rtol=0, atol=1e-4)
    assert packed  # the limit was reached
    mirror = state.mirror(1)
    assert mirror.live_token_ids() == reference.mirror.live_token_ids()
    keys, _ = state.rows(1)
    expected, _ = layer0_oracle(lm, mirror.live_token_ids(), mirror.positions())
    torch.testing.assert_close(keys[0], expected[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("heads", [1, 2])  # lanes per layer: the whole layer, or each kv head
def test_lanes_keep_their_own_rows_as_the_per_layer_state_does(tiny, heads):
    """Each lane drops its own rows every round (a sequence of shared rows beside it): the
    per-lane rows, positions, K/V and next tokens are those of a per-layer StateManager given
    the same drops, and the union's live map is the same."""
    from positronic.state import rows as row_plans

    ids, lanes = prompt(81, 50), tiny.num_layers * heads
    reference = StateManager.from_tokens(tiny, ids, capacity=CAPACITY)
    reference.split_layers(heads)
    joining = StateManager.from_tokens(tiny, ids, capacity=CAPACITY)
    joining.split_layers(heads)
    state = SlotState(tiny, slots=2, capacity=CAPACITY, lanes=lanes)
    state.join(StateManager.from_tokens(tiny, prompt(82, 30), capacity=CAPACITY))
    state.join(joining)
    rng = random.Random(4)
    for _ in range(30):
        token, rows = int(reference.next_logits.argmax()), reference.rows_per_layer
        drops = [sorted(rng.sample(range(1, rows - 1), 2)) if rows > 45 else [] for _ in range(lanes)]
        deleted = torch.zeros((2, lanes, CAPACITY), dtype=torch.bool)
        for lane, dropped in enumerate(drops):
            deleted[1, lane, dropped] = True
        report = state.apply(deleted, [int(state.next_logits[0].argmax()), token])
        reference.apply(([{"action": "drop", "rows": drops}] if any(drops) else []) + [{"action": "add", "token_id": token}])
        assert not report.failed
        assert int(state.next_logits[1].argmax()) == int(reference.next_logits.argmax())
        torch.testing.assert_close(state.next_logits[1], reference.next_logits, rtol=0, atol=1e-5)
    mirror, rows = state.mirror(1), reference.rows_per_layer
    assert mirror.layers.rows == reference.mirror.layers.rows
    assert mirror.live_token_ids() == reference.mirror.live_token_ids()
    assert state.positions[1, :, :rows].tolist() == row_plans.lane_positions(reference.mirror)
    keys, values = state.rows(1)
    saved = reference.tensors()
    torch.testing.assert_close(keys, saved["keys"], rtol=0, atol=1e-5)
    torch.testing.assert_close(values, saved["values"], rtol=0, atol=1e-5)
    mirror.check(tiny.max_positions)
    assert state.mirror(0).layers is None and state.positions[0, 0].tolist() == state.positions[0, -1].tolist()


def test_lanes_that_would_keep_different_numbers_of_rows_are_refused(tiny):
    joining = StateManager.from_tokens(tiny, prompt(91, 40), capacity=CAPACITY)
    joining.split_layers(1)
    state = SlotState(tiny, slots=1, capacity=CAPACITY, lanes=tiny.num_layers)
    state.join(joining)
    deleted = torch.zeros((1, tiny.num_layers, CAPACITY), dtype=torch.bool)
    deleted[0, 0, 5] = True
    with pytest.raises(ValueError, match=r"sequence 0: its lanes would keep different numbers of rows \(\[39, 40\]\)"):
        state.apply(deleted, [7])
    assert state.tick(0) == 0 and int(state.length[0]) == 40


def test_a_joining_sequences_shorter_per_sequence_tensor_fills_the_leading_part_and_a_larger_one_is_refused(tiny):
    """What a press's index relies on (recall carries only its filled slots): the rest of the
    slot's tensor is at the fill, not what the slot's last sequence left there."""
    state = SlotState(tiny, slots=2, capacity=CAPACITY)
    state.declare_sequence("index", (3, 5), torch.float32, -1.0)
    state.join(StateManager.from_tokens(tiny, prompt(1, 20), capacity=64), sequence_state={"index": torch.ones(3, 5)})
    state.leave(0)
    state.join(StateManager.from_tokens(tiny, prompt(2, 20), capacity=64),
               sequence_state={"index": torch.full((3, 2), 7.0)})
    index = state.sequence_state["index"][0]
    assert index[:, :2].eq(7).all() and index[:, 2:].eq(-1).all()
    with pytest.raises(ValueError, match=r"per-sequence state 'index' is \(3, 5\) a sequence, got \(3, 6\)"):
        state.join(StateManager.from_tokens(tiny, prompt(3, 20), capacity=64),
                   sequence_state={"index": torch.zeros(3, 6)})


# the Step 4 contract's action lists as a round's edit (SlotState.apply_edits)

def test_action_lists_make_each_sequences_round_as_the_single_sequence_state_makes_it(tiny):
    """Three sequences, one of them with rows per lane, 30 rounds of the action lists a policy
    hands Step 4 (deletes or a drop, then an add), each checked against its sequence's bounds
    (the single-sequence state's, for the same sequence): each one's live rows, per-lane rows,
    positions and next tokens are those of a StateManager given the same lists."""
    heads, lanes = 1, tiny.num_layers
    references = [StateManager.from_tokens(tiny, prompt(k, 46 + 3 * k), capacity=CAPACITY) for k in range(3)]
    references[2].split_layers(heads)
    state = SlotState(tiny, slots=3, capacity=CAPACITY, lanes=lanes)
    for k in range(3):
        joining = StateManager.from_tokens(tiny, prompt(k, 46 + 3 * k), capacity=CAPACITY)
        if k == 2:
            joining.split_layers(heads)
        state.join(joining)
    rng = random.Random(7)
    for _ in range(30):
        lists = []
        for k, reference in enumerate(references):
            assert state.bounds(k) == reference.bounds
            token = int(reference.next_logits.argmax())
            if reference.per_layer:
                rows = reference.rows_per_layer
                drops = [sorted(rng.sample(range(1, rows - 1), 2)) if rows > 45 else [] for _ in range(lanes)]
                edits = [{"action": "drop", "rows": drops}] if any(drops) else []
            else:
                edits = [{"action": "delete", "position": row} for row in deletions(rng, len(reference))]
            lists.append(edits + [{"action": "add", "token_id": token}])
        report = state.apply_edits([Edit.from_actions(actions, state.bounds(k)) for k, actions in enumerate(lists)])
        assert not report.failed
        for k, (reference, actions) in enumerate(zip(references, lists)):
            reference.apply(actions)
            assert int(state.next_logits[k].argmax()) == int(reference.next_logits.argmax())
            torch.testing.assert_close(state.next_logits[k], reference.next_logits, rtol=0, atol=1e-5)
    for k, reference in enumerate(references):
        mirror = state.mirror(k)
        assert mirror.live_token_ids() == reference.mirror.live_token_ids()
        assert mirror.positions() == reference.mirror.positions()
        assert (mirror.layers.rows if mirror.layers else None) == \
            (reference.mirror.layers.rows if reference.mirror.layers else None)
        mirror.check(tiny.max_positions)


@pytest.mark.parametrize("actions, message", [
    ([{"action": "replace_pair", "original_pos1": 5, "original_pos2": 6, "new_token_ids": [9]},
      {"action": "add", "token_id": 4}], "sequence 1: replace_pair"),
    ([{"action": "restore", "ledger_ids": [0]}, {"action": "add", "token_id": 4}], "sequence 1: restore"),
    ([{"action": "delete", "position": 3}], "sequence 1: a round adds one token to every sequence, this list adds 0"),
    ([{"action": "add", "token_id": 4}, {"action": "add", "token_id": 5}], "this list adds 2"),
])
def test_an_action_list_a_round_cannot_make_is_refused_by_name_and_nothing_changes(tiny, actions, message):
    state = SlotState(tiny, slots=2, capacity=CAPACITY)
    for k in range(2):
        state.join(StateManager.from_tokens(tiny, prompt(k, 30), capacity=CAPACITY))
    before = [(state.mirror(k).live_token_ids(), state.positions[k].clone()) for k in range(2)]
    length, logits = state.length.clone(), state.next_logits.clone()
    first = Edit.from_actions([{"action": "add", "token_id": 3}], state.bounds(0))
    with pytest.raises(ActionError, match=message):
        state.apply_edits([first, Edit.from_actions(actions, state.bounds(1))])
    elsewhere = Bounds(5, tiny.vocab_size, tiny.max_positions)  # another state's
    with pytest.raises(ActionError, match="sequence 1: the edit was checked against"):
        state.apply_edits([first, Edit.from_actions([{"action": "add", "token_id": 3}], elsewhere)])
    assert torch.equal(state.length, length) and torch.equal(state.next_logits, logits)
    for k in range(2):
        assert state.mirror(k).live_token_ids() == before[k][0] and torch.equal(state.positions[k], before[k][1])


def test_the_committed_fixtures_a_round_can_make_replay_in_core_v4(smol):
    """The captured ticks whose action lists a round makes (deletes and an add; the repairs are
    the single-sequence state's) replay in a SlotState, beside another sequence, to what the
    fixture recorded: the live tokens and positions, layer 0's K/V within the replay's
    tolerance, and the first greedy token."""
    from positronic.fixtures import load_fixture
    from positronic.fixtures.replay import tolerance

    played = 0
    for path in sorted(Path(__file__).resolve().parents[3].glob("fixtures/*.pt")):
        fixture = load_fixture(path)
        if fixture.fault or any(a["action"] not in ("delete", "add") for a in fixture.actions):
            continue
        fresh = StateManager.from_mirror(smol, fixture.mirror(), brightness=fixture.new_brightness)
        state = SlotState(smol, slots=2, capacity=len(fresh) + 8)
        state.join(StateManager.from_tokens(smol, prompt(3, 20), capacity=len(fresh) + 8))
        state.join(fresh)
        edits = [Edit.from_actions([{"action": "add", "token_id": 5}], state.bounds(0)),
                 Edit.from_actions(fixture.actions, state.bounds(1))]
        assert not state.apply_edits(edits).failed
        expected, mirror = fixture.expected, state.mirror(1)
        assert mirror.live_token_ids() == expected.live_ids and mirror.positions() == expected.positions, path.name
        keys, values = state.rows(1)
        rows = expected.layer0_rows
        torch.testing.assert_close(keys[0][:, rows], expected.layer0_keys, rtol=0, atol=tolerance(fixture.dtype))
        torch.testing.assert_close(values[0][:, rows], expected.layer0_values, rtol=0, atol=tolerance(fixture.dtype))
        assert int(state.next_logits[1].argmax()) == expected.greedy[0], path.name
        played += 1
    assert played == 2, "api_delete_row4.pt and api_delete_last_row.pt"
