import pytest

from positronic.steps.consolidate import consolidate

REPLACE = {"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": [9]}
DELETE = {"action": "delete", "position": 10}


def test_edits_first_in_order_then_add():
    out = consolidate(7, [DELETE, REPLACE])
    assert out == [DELETE, REPLACE, {"action": "add", "token_id": 7}]


def test_no_add():
    assert consolidate(None, [REPLACE]) == [REPLACE]
    assert consolidate(None, []) == []
    assert consolidate(3, []) == [{"action": "add", "token_id": 3}]


def test_output_is_a_copy():
    out = consolidate(1, [REPLACE])
    out[0]["new_token_ids"].append(5)
    out[0]["original_pos1"] = 0
    assert REPLACE == {"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": [9]}


def test_adjacent_non_overlapping_pairs_are_fine():
    other = {**REPLACE, "original_pos1": 6, "original_pos2": 7}
    assert len(consolidate(None, [REPLACE, other, {"action": "delete", "position": 3}])) == 3


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
    with pytest.raises(ValueError, match="touched by two actions") as err:
        consolidate(1, [REPLACE, second])
    assert repr(REPLACE) in str(err.value) and repr(second) in str(err.value)


def test_repeated_delete_conflicts():
    with pytest.raises(ValueError, match="row 10"):
        consolidate(None, [DELETE, dict(DELETE)])


def test_rows_inside_a_non_adjacent_pair_count_as_touched():
    wide = {"action": "replace_pair", "original_pos1": 4, "original_pos2": 7, "new_token_ids": [1]}
    with pytest.raises(ValueError, match="row 6"):
        consolidate(None, [wide, {"action": "delete", "position": 6}])


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
        consolidate(1, [bad])


@pytest.mark.parametrize("token", [True, 1.0, "3"])
def test_bad_add_token_raises(token):
    with pytest.raises(ValueError, match="add_token_id"):
        consolidate(token, [])
