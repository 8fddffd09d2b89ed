"""The action dicts (positronic/state/actions.py), the wire format of an edit: the summary an
event log gets and the rows an action edits. Their checks are tests/positronic/state/test_edit.py."""

import torch

from positronic.state.actions import loggable, rows_of


def stored(rows=2, **changes):
    action = {"action": "restore", "ledger_ids": list(range(20, 20 + rows)), "keys": torch.randn(3, 2, rows, 4),
              "values": torch.randn(3, 2, rows, 4), "predicted": [7] * rows}
    return action | changes


def test_the_event_log_gets_a_restores_kv_as_its_shape_and_everything_else_as_given():
    action = stored(rows=3)
    assert loggable(action) == {"action": "restore", "ledger_ids": [20, 21, 22], "stored": [3, 2, 3, 4]}
    plain = {"action": "replace_pair", "original_pos1": 1, "original_pos2": 2, "new_token_ids": [5]}
    logged = loggable(plain)
    assert logged == plain and logged is not plain
    assert loggable({"action": "restore", "ledger_ids": [1]}) == {"action": "restore", "ledger_ids": [1]}
    assert rows_of(plain) == (1, 2) and rows_of({"action": "delete", "position": 4}) == (4,)
    assert rows_of({"action": "add", "token_id": 3}) == () and rows_of(action) == ()
