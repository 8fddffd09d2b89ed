"""Step 3e (steps/consolidate.py): the generated token and the policy's actions become one
Edit, checked once (its checks in full: tests/positronic/state/test_edit.py)."""

import pytest

from positronic.state.actions import ActionError
from positronic.state.edit import Bounds, Edit
from positronic.steps.consolidate import consolidate

BOUNDS = Bounds(live_length=16, vocab_size=50, max_length=64)

REPLACE = {"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": [9]}
DELETE = {"action": "delete", "position": 10}


def test_edits_first_in_order_then_add():
    out = consolidate(7, [DELETE, REPLACE], BOUNDS)
    assert isinstance(out, Edit) and out.bounds == BOUNDS
    assert list(out.actions) == [DELETE, REPLACE, {"action": "add", "token_id": 7}]
    assert out.deletes == (10,) and out.replacements[0].rows == (4, 5) and out.adds == (7,)


def test_no_add():
    assert list(consolidate(None, [REPLACE], BOUNDS).actions) == [REPLACE]
    assert list(consolidate(None, [], BOUNDS).actions) == []
    assert list(consolidate(3, [], BOUNDS).actions) == [{"action": "add", "token_id": 3}]


def test_output_is_a_copy():
    out = consolidate(1, [REPLACE], BOUNDS)
    out.actions[0]["new_token_ids"].append(5)
    out.actions[0]["original_pos1"] = 0
    assert REPLACE == {"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": [9]}
    assert out.replacements[0].rows == (4, 5) and out.replacements[0].token_ids == (9,), "the edit is fixed once built"


def test_adjacent_non_overlapping_pairs_are_fine():
    other = {**REPLACE, "original_pos1": 6, "original_pos2": 7}
    assert len(consolidate(None, [REPLACE, other, {"action": "delete", "position": 3}], BOUNDS)) == 3


@pytest.mark.parametrize(
    "second",
    [
        {"action": "delete", "position": 5},
        {"action": "delete", "position": 4},
        {"action": "replace_pair", "original_pos1": 5, "original_pos2": 6, "new_token_ids": [1]},
        {"action": "replace_pair", "original_pos1": 3, "original_pos2": 4, "new_token_ids": [1]},
    ],
)
def test_conflict_names_both_actions(second):
    with pytest.raises(ActionError, match="is already edited by action 0") as err:
        consolidate(1, [REPLACE, second], BOUNDS)
    assert str(err.value).startswith(f"action 1 ({second['action']}): ")


def test_repeated_delete_conflicts():
    with pytest.raises(ValueError, match="position=10 is already edited by action 0"):
        consolidate(None, [DELETE, dict(DELETE)], BOUNDS)


def test_a_non_adjacent_pair_is_refused():
    """Rows inside a wide pair would be neither kept in place nor replaced: the pair itself is refused."""
    wide = {"action": "replace_pair", "original_pos1": 4, "original_pos2": 7, "new_token_ids": [1]}
    with pytest.raises(ValueError, match="not adjacent rows"):
        consolidate(None, [wide, {"action": "delete", "position": 6}], BOUNDS)


@pytest.mark.parametrize(
    "bad",
    [
        {"action": "add", "token_id": 3},
        {"action": "move", "position": 3},
        {"action": "delete"},
        {"action": "delete", "position": True},
        {"action": "delete", "position": -1},
        {"action": "replace_pair", "original_pos1": 5, "original_pos2": 5, "new_token_ids": [1]},
        {"action": "replace_pair", "original_pos1": 6, "original_pos2": 5, "new_token_ids": [1]},
        {"action": "replace_pair", "original_pos1": "4", "original_pos2": 5, "new_token_ids": [1]},
        "delete",
    ],
)
def test_malformed_actions_raise(bad):
    with pytest.raises(ValueError):
        consolidate(1, [bad], BOUNDS)


@pytest.mark.parametrize("token", [True, 1.0, "3"])
def test_bad_add_token_raises(token):
    with pytest.raises(ValueError, match="add_token_id"):
        consolidate(token, [], BOUNDS)
