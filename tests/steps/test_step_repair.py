from types import SimpleNamespace

import pytest

from steps.consolidate import consolidate
from steps.repair import RepairPlan, Repairer, plan_repairs

PAIRS = [(4, 5), (8, 9), (12, 13)]


class Echo:
    """Proposes the pair's first token again, read from the context view it is given."""

    def propose(self, view, pair):
        return [view.token_ids[pair[0]]]


def test_repairer_protocol_is_structural():
    assert isinstance(Echo(), Repairer)
    assert not isinstance(object(), Repairer)
    view = SimpleNamespace(token_ids=[10, 11, 12], predicted=[20, 21, 22])  # the fields a repairer may read
    assert Echo().propose(view, (1, 2)) == [11]


def test_plan_when_budget_must_be_met():
    plan = plan_repairs(PAIRS, [[7], [], [1, 2]], must_meet_budget=True)
    assert isinstance(plan, RepairPlan)
    assert plan.actions == [
        {"action": "replace_pair", "original_pos1": 4, "original_pos2": 5, "new_token_ids": [7]},
        {"action": "delete", "position": 8},
        {"action": "delete", "position": 9},
        {"action": "replace_pair", "original_pos1": 12, "original_pos2": 13, "new_token_ids": [1, 2]},
    ]
    assert plan.outcomes == [((4, 5), "replaced"), ((8, 9), "deleted"), ((12, 13), "replaced")]


def test_plan_when_budget_need_not_be_met_leaves_unproposed_pairs():
    plan = plan_repairs(PAIRS, [[], [3], []], must_meet_budget=False)
    assert plan.actions == [
        {"action": "replace_pair", "original_pos1": 8, "original_pos2": 9, "new_token_ids": [3]},
    ]
    assert plan.outcomes == [((4, 5), "left"), ((8, 9), "replaced"), ((12, 13), "left")]


def test_plan_copies_proposals():
    proposal = [7, 8]
    plan = plan_repairs([(4, 5)], [proposal], must_meet_budget=True)
    proposal.append(9)
    assert plan.actions[0]["new_token_ids"] == [7, 8]


def test_empty_plan():
    assert plan_repairs([], [], must_meet_budget=True) == RepairPlan([], [])


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="one proposal per pair"):
        plan_repairs(PAIRS, [[1]], must_meet_budget=True)


def test_plan_feeds_consolidate():
    plan = plan_repairs(PAIRS, [[7], [], [1, 2]], must_meet_budget=True)
    actions = consolidate(42, plan.actions)
    assert actions[:-1] == plan.actions
    assert actions[-1] == {"action": "add", "token_id": 42}
