"""Steps 3c-3d: the repairer interface and turning its proposals into actions.

The real repairers need the model and live elsewhere; this module only fixes the contract.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

REPLACED, DELETED, LEFT = "replaced", "deleted", "left"


@runtime_checkable
class Repairer(Protocol):
    def propose(self, view, pair: tuple[int, int]) -> list[int]:
        """Replacement token ids for the rows `pair` of the context `view` (a read-only
        ContextView: token ids, positions, the model's predictions, … in cache order); an
        empty list means no proposal."""
        ...


@dataclass(frozen=True)
class RepairPlan:
    """Actions for Step 3e, and per selected pair what becomes of it
    ("replaced", "deleted" or "left") for the tick record."""

    actions: list[dict]
    outcomes: list[tuple[tuple[int, int], str]]


def plan_repairs(
    pairs: Sequence[tuple[int, int]],
    proposals: Sequence[Sequence[int]],
    *,
    must_meet_budget: bool,
) -> RepairPlan:
    """One proposal per pair (same order). A non-empty proposal replaces the pair; an empty
    one deletes both rows when the budget must be met, and otherwise leaves them alone."""
    if len(pairs) != len(proposals):
        raise ValueError(f"need one proposal per pair: {len(pairs)} pairs, {len(proposals)} proposals")
    actions: list[dict] = []
    outcomes: list[tuple[tuple[int, int], str]] = []
    for (p1, p2), ids in zip(pairs, proposals):
        pair = (p1, p2)
        if ids:
            actions.append({"action": "replace_pair", "original_pos1": p1,
                            "original_pos2": p2, "new_token_ids": list(ids)})
            outcomes.append((pair, REPLACED))
        elif must_meet_budget:
            actions += [{"action": "delete", "position": p1}, {"action": "delete", "position": p2}]
            outcomes.append((pair, DELETED))
        else:
            outcomes.append((pair, LEFT))
    return RepairPlan(actions=actions, outcomes=outcomes)
