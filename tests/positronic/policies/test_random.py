"""`--policy random` (positronic/policies/random.py): uniformly random selectable rows go, drawn
from the run's seed, reproducibly, within the shared rules, and a resumed run goes on exactly."""

import pytest
import torch

from positronic.brain import session as sessions
from positronic.brain.loop import Brain, BrainConfig
from positronic.policies import POLICIES, make_policy
from positronic.state.actions import loggable
from positronic.state import ContextView

PROMPT = list(range(10, 30))


def view_of(n: int, pinned=()) -> ContextView:
    pins = torch.zeros(n, dtype=torch.bool)
    pins[list(pinned)] = True
    return ContextView(token_ids=torch.full((n,), 5), ledger_ids=torch.arange(1000, 1000 + n), positions=torch.arange(n),
                       brightness=torch.full((n,), 255.0), predicted=torch.full((n,), 6), pinned=pins)


def deleted(plan) -> list[int]:
    assert all(a["action"] == "delete" for a in plan.actions)
    return sorted(a["position"] for a in plan.actions)


def run(lm, ticks: int, **settings) -> list:
    brain = Brain.start(lm, [lm.bos_id] + PROMPT, BrainConfig(policy="random", budget=48, **settings))
    return [brain.step() for _ in range(ticks)]


def edits(records) -> list:
    return [(r.token_id, [loggable(a) for a in r.actions]) for r in records]


def test_registered_and_refused_without_room():
    assert "random" in POLICIES
    with pytest.raises(ValueError, match="evictable rows"):
        BrainConfig(policy="random", budget=140, protect=100).validate()


def test_the_same_seed_evicts_the_same_rows_and_another_seed_others(tiny):
    first, again = run(tiny, 60, seed=3, temperature=0), run(tiny, 60, seed=3, temperature=0)
    other = run(tiny, 60, seed=4, temperature=0)  # greedy: only the policy's draws depend on the seed
    assert any(a["action"] == "delete" for r in first for a in r.actions)
    assert edits(first) == edits(again)
    removed = [[[x["ledger_id"] for x in r.removed] for r in records] for records in (first, other)]
    assert removed[0] != removed[1], "another seed, other rows evicted"


def test_it_draws_uniformly_among_the_selectable_rows_only(tiny):
    """Sinks (4), the protected prefix (6), the recent window (max(32, 100 // 4)) and the
    pinned rows never go; every other row goes sometimes."""
    config = BrainConfig(policy="random", budget=100, sinks=4, protect=6)
    config.validate()
    policy, counts = make_policy("random", tiny, config), [0] * 100
    for _ in range(300):
        plan = policy.plan(view_of(100, pinned=(20, 21)), [0.01] * 100, {})
        policy.commit(plan.next)
        rows = deleted(plan)
        assert len(rows) == 100 + 1 - (100 - 100 // 16)
        for row in rows:
            counts[row] += 1
    selectable = [row for row in range(6, 100 - 32) if row not in (20, 21)]
    assert all(counts[row] == 0 for row in range(100) if row not in selectable)
    assert min(counts[row] for row in selectable) > 0


def test_budget_sinks_and_pins_hold_in_a_run(tiny):
    prompt = [tiny.bos_id] + tiny.encode("filler text and more filler text, the code is 4817, then filler" * 2)
    brain = Brain.start(tiny, prompt, BrainConfig(policy="random", budget=64, sinks=4, seed=2), pins=["4817"])
    ledger, prefix = brain.state.mirror.ledger, brain.state.mirror.live.ledger_ids[:4]
    pinned = [i for i, e in enumerate(ledger.entries) if e.pinned]
    for _ in range(150):
        assert brain.step().live_length <= 64
    assert brain.state.mirror.live.ledger_ids[:4] == prefix and all(ledger[i].state == "live" for i in pinned)
    assert ledger.count("culled") > 40
    brain.state.check(deep=True)


def test_a_failed_tick_draws_nothing_and_a_resumed_session_goes_on_exactly(tiny, tmp_path):
    brain = Brain.start(tiny, [tiny.bos_id] + PROMPT, BrainConfig(policy="random", budget=48, seed=5))
    while len(brain.state) < 48:
        brain.step()
    brain.state.inject_fault("forward")
    failed = brain.step()
    assert failed.rebuilt and any(a["action"] == "delete" for a in failed.actions)
    retried = brain.step(force=failed.token_id)
    assert retried.actions[:-1] == failed.actions[:-1], "the retried tick draws the same rows"
    for _ in range(7):
        brain.step()
    sessions.save(tmp_path, brain, tiny.name)
    resumed = sessions.resume(tiny, tmp_path)
    assert resumed.policy.state() == brain.policy.state()
    assert edits([brain.step() for _ in range(40)]) == edits([resumed.step() for _ in range(40)])


def test_it_differs_from_streaming(tiny):
    views = {name: make_policy(name, tiny, BrainConfig(policy=name, budget=100)) for name in ("random", "streaming")}
    rows = {name: deleted(policy.plan(view_of(100), [0.01] * 100, {})) for name, policy in views.items()}
    assert rows["streaming"] == list(range(4, 11)) and rows["random"] != rows["streaming"]
    assert len(rows["random"]) == 7 and min(rows["random"]) >= 4 and max(rows["random"]) < 100 - 32
