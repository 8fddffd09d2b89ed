"""An action list becoming an Edit (positronic/state/edit.py) on its own: the order a valid
list is applied in, the length it leaves, the per-layer drop and the restore with its own
K/V, the layout inputs it gives. That a refused list leaves the state untouched is the
StateManager's (tests/positronic/state/test_manager.py, every kind of bad list)."""

import pytest
import torch

from positronic.mirror import Insertion
from positronic.state.actions import ActionError, rows_of
from positronic.state.edit import Bounds, Edit, Replacement, validate

LIMITS = dict(live_length=10, vocab_size=50, max_length=16)


def test_edits_run_from_the_highest_row_down_and_adds_last_in_list_order():
    actions = [{"action": "add", "token_id": 1},
               {"action": "delete", "position": 2},
               {"action": "replace_pair", "original_pos1": 6, "original_pos2": 7, "new_token_ids": [3, 4, 5]},
               {"action": "add", "token_id": 2},
               {"action": "delete", "position": 9},
               {"action": "restore", "ledger_ids": [12, 13]}]
    plan = validate(actions, **LIMITS)
    assert [rows_of(a) for a in plan.edits] == [(9,), (6, 7), (2,)]
    assert list(plan.adds) == [1, 2]
    assert plan.final_length == 10 + 2 - 2 + 1 + 2, "adds, deletes, a pair of 2 by 3 tokens, two restores"
    assert plan.restores == (12, 13) and plan.stored == {} and plan.drops is None
    assert validate([], **LIMITS).final_length == 10


@pytest.mark.parametrize("actions, message", [
    ({"action": "add", "token_id": 1}, "action list must be a list, got dict"),
    ([("add", 1)], r"action 0: must be a dict, got tuple"),
    ([{"action": "grow"}], r"unknown action 'grow'; expected one of add, replace_pair, delete, restore, drop"),
    ([{"action": "add", "token_id": 1, "colour": "red"}], r"action 0 \(add\): unknown key\(s\) colour"),
    ([{"action": "replace_pair", "original_pos1": 1}], r"missing key\(s\) original_pos2, new_token_ids"),
    ([{"action": "delete", "position": 3}, {"action": "replace_pair", "original_pos1": 3, "original_pos2": 4,
                                             "new_token_ids": [1]}],
     r"action 1 \(replace_pair\): original_pos1=3 is already edited by action 0"),
    ([{"action": "delete", "position": 2.0}], "position must be an int, got float"),
    ([{"action": "restore", "ledger_ids": []}], "ledger_ids must be a non-empty list"),
    ([{"action": "restore", "ledger_ids": [4, -1]}], "ledger_ids must be a non-empty list"),
    ([{"action": "restore", "ledger_ids": [4]}, {"action": "restore", "ledger_ids": [5, 4]}],
     r"action 1 \(restore\): ledger id 4 is already restored by action 0"),
    ([{"action": "restore", "ledger_ids": [4], "keys": torch.zeros(2, 1, 1, 4)}],
     "keys, values and predicted come together"),
    ([{"action": "drop", "rows": [[1], [2]]}], "drop names rows per layer"),
    ([{"action": "add", "token_id": 1}] * 7, "would grow the context to 17 rows, beyond the model's 16"),
])
def test_a_bad_list_is_refused_naming_the_action_and_the_problem(actions, message):
    with pytest.raises(ActionError, match=message):
        validate(actions, **LIMITS)


def stored(rows=2, **changes):
    action = {"action": "restore", "ledger_ids": list(range(20, 20 + rows)), "keys": torch.randn(3, 2, rows, 4),
              "values": torch.randn(3, 2, rows, 4), "predicted": [7] * rows}
    return action | changes


def test_a_restore_with_its_own_kv_is_split_per_row_and_checked_for_form():
    action = stored()
    plan = validate([action], **LIMITS)
    assert sorted(plan.stored) == [20, 21]
    keys, values, predicted = plan.stored[21]
    assert torch.equal(keys, action["keys"][:, :, 1]) and torch.equal(values, action["values"][:, :, 1])
    assert predicted == 7
    for bad, message in [(dict(keys=torch.randn(3, 2, 3, 4)), r"keys must be a tensor \[layers, kv_heads, 2, head_dim\]"),
                         (dict(values=torch.full((3, 2, 2, 4), float("nan"))), "values must be finite"),
                         (dict(values=torch.randn(3, 1, 2, 4)), "differ in shape"),
                         (dict(keys=torch.ones(3, 2, 2, 4, dtype=torch.int64)), "finite floating-point"),
                         (dict(predicted=[7, 50]), "predicted must be 2 token ids in the vocabulary")]:
        with pytest.raises(ActionError, match=message):
            validate([stored(**bad)], **LIMITS)


def test_a_per_layer_state_takes_add_and_one_drop_of_as_many_rows_in_every_layer():
    layers = (2, 6)  # two layers of six rows
    plan = validate([{"action": "drop", "rows": [[0, 5], [3, 1]]}, {"action": "add", "token_id": 4}],
                    **LIMITS, layers=layers)
    assert plan.drops == ((0, 5), (3, 1)) and plan.final_length == 6 - 2 + 1 and plan.edits == []
    for actions, message in [
        ([{"action": "delete", "position": 1}], "takes add, drop, restore and reread actions only"),
        ([{"action": "drop", "rows": [[1]]}], "rows must be a list of 2 lists"),
        ([{"action": "drop", "rows": [[1], [6]]}], r"layer 1: rows must be ints in 0\.\.5"),
        ([{"action": "drop", "rows": [[1, 1], [2, 3]]}], "layer 0: a row is dropped twice"),
        ([{"action": "drop", "rows": [[1], [2, 3]]}], "every lane must end with as many rows"),
        ([{"action": "drop", "rows": [[1], [2]]}, {"action": "drop", "rows": [[3], [4]]}], "one drop action per list"),
        ([{"action": "drop", "rows": [list(range(6)), list(range(6))]}], "would leave the context empty"),
        ([{"action": "add", "token_id": 1}, {"action": "add", "token_id": 2}], "adds at most one token per edit"),
    ]:
        with pytest.raises(ActionError, match=message):
            validate(actions, **LIMITS, layers=layers)


def test_a_per_layer_restore_names_its_lanes_and_keeps_every_lane_as_long():
    """A lane that takes a token back drops one more row: lane 1 takes 20 back and drops two."""
    layers = (2, 6)
    kv = {"keys": torch.randn(2, 1, 1, 4), "values": torch.randn(2, 1, 1, 4), "predicted": [3]}
    restore = {"action": "restore", "ledger_ids": [20], "lanes": [[1]], **kv}
    plan = validate([{"action": "drop", "rows": [[0], [3, 1]]}, restore, {"action": "add", "token_id": 4}],
                    **LIMITS, layers=layers)
    assert plan.lane_inserts() == [[], [20]] and plan.final_length == 6 - 1 + 1 and set(plan.stored) == {20}
    for actions, message in [
        ([{"action": "drop", "rows": [[0], [1]]}, restore], "every lane must end with as many rows"),
        ([{"action": "drop", "rows": [[0], [3, 1]]}, {**restore, "lanes": [[1, 1]]}], "lanes must be distinct ints"),
        ([{"action": "drop", "rows": [[0], [3, 1]]}, {**restore, "lanes": [[2]]}], r"lanes must be distinct ints in 0\.\.1"),
        ([{"action": "drop", "rows": [[0], [3, 1]]}, {**restore, "lanes": []}], "lanes must be 1 non-empty lists"),
        ([{"action": "restore", "ledger_ids": [20], "lanes": [[1]]}], "with their own K/V"),
        ([{"action": "restore", "ledger_ids": [20], **kv}], "names the lanes"),
    ]:
        with pytest.raises(ActionError, match=message):
            validate(actions, **LIMITS, layers=layers)
    with pytest.raises(ActionError, match="lanes name the lanes of a per-layer state"):
        validate([restore], **LIMITS)


def test_a_reread_keeps_the_newest_row_and_comes_without_an_add():
    """The newest row's forward again, after the other edits: never beside an add (whose forward
    would be the newest), never with the newest row deleted, replaced or dropped in some layer."""
    plan = validate([{"action": "delete", "position": 3}, {"action": "reread"}], **LIMITS)
    assert plan.reread and plan.deletes == (3,) and plan.final_length == 9 and plan.adds == ()
    assert not validate([{"action": "delete", "position": 3}], **LIMITS).reread
    layers = (2, 6)
    lanes = validate([{"action": "drop", "rows": [[0], [4]]}, {"action": "reread"}], **LIMITS, layers=layers)
    assert lanes.reread and lanes.final_length == 5
    for actions, bounds, message in [
        ([{"action": "reread"}, {"action": "add", "token_id": 1}], {}, "reread or add, not both"),
        ([{"action": "delete", "position": 9}, {"action": "reread"}], {}, r"action 0 edits the newest row \(row 9\)"),
        ([{"action": "replace_pair", "original_pos1": 8, "original_pos2": 9, "new_token_ids": [1]},
          {"action": "reread"}], {}, "edits the newest row"),
        ([{"action": "reread"}, {"action": "reread"}], {}, "already reread by action 0"),
        ([{"action": "reread", "row": 2}], {}, "unknown key"),
        ([{"action": "drop", "rows": [[0], [5]]}, {"action": "reread"}], {"layers": layers},
         r"out of layer 1; a reread keeps it"),
    ]:
        with pytest.raises(ActionError, match=message):
            validate(actions, **LIMITS, **bounds)


def test_an_edit_keeps_typed_parts_and_gives_the_layout_inputs():
    actions = [{"action": "add", "token_id": 1},
               {"action": "delete", "position": 2},
               {"action": "replace_pair", "original_pos1": 6, "original_pos2": 7, "new_token_ids": [3, 4]},
               {"action": "delete", "position": 9}]
    edit = Edit.from_actions(actions, Bounds(**LIMITS))
    assert edit == validate(actions, **LIMITS) and len(edit) == 4
    assert edit.deletes == (9, 2) and edit.replacements == (Replacement((6, 7), (3, 4)),) and edit.adds == (1,)
    assert sorted(edit.deleted_rows()) == [2, 6, 7, 9]
    back = Insertion(3, (8,), "prompt", positions=(3,), restores=(15,))
    assert edit.insertions("generated", [back]) == [
        Insertion(6, (3, 4), "repair", replaces=(6, 7)), back, Insertion(10, (1,), "generated")]
    assert list(edit.actions) == actions and edit.actions[2] is not actions[2], "the edit keeps its own copies"
    actions[2]["new_token_ids"].append(5)
    assert edit.actions[2]["new_token_ids"] == [3, 4] and edit.replacements[0].token_ids == (3, 4)
    with pytest.raises(AttributeError):
        edit.adds = (2,)  # frozen


