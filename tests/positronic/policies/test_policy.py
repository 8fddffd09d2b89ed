"""The policy framework (positronic/policies/, positronic/policies/scorers.py) on crafted states and in real runs."""

import pytest
import torch

from positronic.brain.loop import Brain, BrainConfig
from positronic.policies import (POLICIES, H2OPolicy, NoEvictionPolicy, ScoredPolicy, StreamingPolicy, batch_size,
                               make_policy, recent_window)
from positronic.brain.runner import Runner
from positronic.state import ContextView, StateManager


def state(lm, rows: int) -> StateManager:
    """A live cache of `rows` tokens (BOS then a fixed pattern of ids)."""
    return StateManager.from_tokens(lm, [lm.bos_id] + [(7 * i) % 500 + 5 for i in range(rows - 1)])


def config(policy: str, budget: int, **kw) -> BrainConfig:
    cfg = BrainConfig(policy=policy, budget=budget, **kw)
    cfg.validate()
    return cfg


def deleted(plan) -> list[int]:
    assert all(a["action"] == "delete" for a in plan.actions)
    return sorted(a["position"] for a in plan.actions)


def committed(policy, view, scores):
    """A plan whose tick went through: its next state becomes the policy's (as the Brain does)."""
    plan = policy.plan(view, scores, {})
    policy.commit(plan.next)
    return plan


def add(sm, token_id: int = 42) -> None:
    sm.apply([{"action": "add", "token_id": token_id}])


def scores_with(length: int, *, low=(), high=(), sinks: int = 4) -> list[float]:
    """Attention-like scores: the sinks take most mass, rows in `low` get 0, rows in `high`
    get 10x the rest; normalised to sum to 1."""
    raw = [1.0] * length
    for row in range(min(sinks, length)):
        raw[row] = 20.0
    for row in high:
        raw[row] = 10.0
    for row in low:
        raw[row] = 0.0
    total = sum(raw)
    return [x / total for x in raw]


def test_registered_and_window_batch_rules():
    assert {"brightness", "streaming", "scored", "h2o", "none"} <= set(POLICIES)
    assert [recent_window(n) for n in (10, 128, 200, 512)] == [32, 32, 50, 128]
    assert [batch_size(b) for b in (10, 48, 128, 512)] == [1, 3, 8, 32]


def view_of(ledger_ids: list[int]) -> ContextView:
    """A hand-made view: all a policy gets to see of the context."""
    n = len(ledger_ids)
    return ContextView(token_ids=torch.full((n,), 5), ledger_ids=torch.tensor(ledger_ids), positions=torch.arange(n),
                       brightness=torch.full((n,), 255.0), predicted=torch.full((n,), 6))


def test_policies_plan_from_the_view_alone(tiny):
    """No StateManager anywhere: the policies read the view (keyed by its ledger ids) and the
    scores, keep no brightness, and refuse scores that do not match the view."""
    ids = [1000 + 3 * row for row in range(100)]
    for name in ("streaming", "scored", "h2o", "none"):
        policy = make_policy(name, tiny, config(name, 100, at_capacity="shift"))
        assert not any(isinstance(value, StateManager) for value in vars(policy).values()), name
        plan = policy.plan(view_of(ids), scores_with(100, low=[50, 60]), {})
        assert plan.brightness is None and not plan.stop, name
        assert len(deleted(plan)) == (48 if name == "none" else 7), name  # none: the older half after the sinks
        if name != "none":  # none only counts the rows
            with pytest.raises(ValueError, match="99 scores for 100 live rows"):
                policy.plan(view_of(ids), scores_with(99), {})
    scored = make_policy("scored", tiny, config("scored", 100))
    assert deleted(committed(scored, view_of(ids), scores_with(100, low=[50, 60]))) == list(range(4, 11))
    assert scored.last_access(ids[70]) == 1 and scored.last_access(70) is None, "keyed by the view's ledger ids"
    h2o = make_policy("h2o", tiny, config("h2o", 100))
    assert deleted(h2o.plan(view_of(ids), scores_with(100, low=[50, 60]), {})) == [4, 5, 6, 7, 8, 50, 60]


def test_streaming_evicts_one_batch_of_the_oldest_middle_rows_only_when_full(tiny):
    sm = state(tiny, 100)
    policy = make_policy("streaming", tiny, config("streaming", 101))
    assert deleted(policy.plan(sm.view(), scores_with(100), {})) == []  # the add fills row 101: still within budget
    policy = make_policy("streaming", tiny, config("streaming", 100))
    plan = policy.plan(sm.view(), scores_with(100), {})
    # batch = 100 // 16 = 6: after the add the cache holds 100 - 6 rows, so 7 rows go
    assert deleted(plan) == list(range(4, 11))
    sm.apply(plan.actions + [{"action": "add", "token_id": 42}])
    assert len(sm) == 100 - 6
    sm.check()


def test_sinks_and_protected_prefix_are_never_evicted(tiny):
    sm = state(tiny, 100)
    for name in ("streaming", "scored", "h2o"):
        policy = make_policy(name, tiny, config(name, 100, sinks=4, protect=20))
        rows = deleted(policy.plan(sm.view(), scores_with(100, low=range(0, 30)), {}))
        assert len(rows) == 7 and min(rows) >= 20, (name, rows)
        policy = make_policy(name, tiny, config(name, 100, sinks=8))
        rows = deleted(policy.plan(sm.view(), scores_with(100, low=range(0, 12), sinks=8), {}))
        assert len(rows) == 7 and min(rows) >= 8, (name, rows)
    shift = make_policy("none", tiny, config("none", 100, at_capacity="shift", sinks=4, protect=10))
    assert deleted(shift.plan(sm.view(), scores_with(100), {})) == list(range(10, 10 + 45))


def test_recent_window_is_a_quarter_of_the_length_once_that_exceeds_32(tiny):
    sm = state(tiny, 200)
    policy = make_policy("h2o", tiny, config("h2o", 160))
    # the newest 60 rows are the least attended: a 32-row window would let 28 of them go
    rows = deleted(policy.plan(sm.view(), scores_with(200, low=range(140, 200)), {}))
    assert len(rows) == 200 + 1 - (160 - 10)
    assert max(rows) < 200 - 50, "rows in the last len/4 = 50 are protected"
    assert set(range(140, 150)) <= set(rows), "the least attended rows before the window go first"


def test_scored_evicts_the_least_recently_accessed_rows(tiny):
    sm = state(tiny, 96)
    policy = make_policy("scored", tiny, config("scored", 100))
    never_again = [12, 30, 50]  # last accessed at tick 1 (the tick they were first seen)
    once_more = [55, 57, 60, 62]  # last accessed at tick 2
    for tick in range(1, 5):
        length = len(sm)
        low = [] if tick == 1 else never_again + (once_more if tick > 2 else [])
        assert deleted(committed(policy, sm.view(), scores_with(length, low=low))) == []
        add(sm)
    # tick 5, cache full (100 rows): rows 20 and 21 are unattended now but were accessed at tick 4
    plan = committed(policy, sm.view(), scores_with(100, low=never_again + once_more + [20, 21]))
    assert deleted(plan) == sorted(never_again + once_more)
    ids = list(sm.mirror.live.ledger_ids)
    kept_id = ids[70]
    assert policy.last_access(kept_id) == 5
    sm.apply(plan.actions + [{"action": "add", "token_id": 42}])
    assert sm.mirror.live.ledger_ids.index(kept_id) == 70 - 7, "the row moved down"
    assert policy.last_access(kept_id) == 5, "its access time follows it (keyed by ledger id)"
    committed(policy, sm.view(), scores_with(len(sm)))
    assert policy.last_access(ids[12]) is None, "evicted rows are forgotten"
    assert policy.last_access(kept_id) == 6


@pytest.mark.parametrize("name", ["scored", "h2o"])
def test_rows_of_a_failed_eviction_keep_their_state(tiny, name):
    """Step 4 fails, the tick changes nothing: the rows the policy chose are still live, keep
    what the policy knew of them, and are chosen again."""
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)),
                        BrainConfig(policy=name, budget=48, sinks=4, seed=1, temperature=0))
    while len(brain.state) < 48:
        assert not any(a["action"] == "delete" for a in brain.step().actions)
    policy = brain.policy
    brain.state.inject_fault("forward")
    record = brain.step()
    assert record.rebuilt and len(brain.state) == 48
    chosen = [brain.state.mirror.live.ledger_ids[a["position"]] for a in record.actions if a["action"] == "delete"]
    assert len(chosen) == 48 + 1 - (48 - batch_size(48))
    assert all(ledger_id in policy.scorer.value for ledger_id in chosen), "not forgotten"
    record = brain.step()
    assert not record.rebuilt
    again = [brain.state.mirror.ledger.entries[i] for i in chosen]
    assert all(entry.state == "culled" for entry in again), "the same rows go when the tick is run again"
    brain.step()
    assert not any(ledger_id in policy.scorer.value for ledger_id in chosen), "forgotten once they are gone"


def test_scored_breaks_ties_by_age(tiny):
    sm = state(tiny, 100)
    policy = make_policy("scored", tiny, config("scored", 100))
    assert deleted(policy.plan(sm.view(), scores_with(100), {})) == list(range(4, 11))


def test_h2o_keeps_heavy_hitters_and_accumulates_attention(tiny):
    sm = state(tiny, 99)
    policy = make_policy("h2o", tiny, config("h2o", 100))
    first = scores_with(99, high=[4, 5, 6, 7, 8, 9, 10], low=range(40, 47))
    assert deleted(committed(policy, sm.view(), first)) == []
    heavy_id = sm.mirror.live.ledger_ids[5]
    add(sm)
    second = scores_with(100)
    rows = deleted(committed(policy, sm.view(), second))
    assert rows == list(range(40, 47)), "the lightest rows go, not the oldest"
    assert policy.accumulated(heavy_id) == pytest.approx(first[5] + second[5])
    streaming = make_policy("streaming", tiny, config("streaming", 100))
    assert deleted(streaming.plan(sm.view(), second, {})) == list(range(4, 11)), "streaming would have lost the heavy hitters"


def test_none_stops_when_the_add_fills_the_cache_or_shifts_out_the_older_half(tiny):
    sm = state(tiny, 98)
    stop = make_policy("none", tiny, config("none", 100, at_capacity="stop"))
    assert isinstance(stop, NoEvictionPolicy)
    plan = stop.plan(sm.view(), scores_with(98), {})
    assert not plan.stop and plan.actions == []
    add(sm)
    plan = stop.plan(sm.view(), scores_with(99), {})
    assert plan.stop and plan.actions == []
    shift = make_policy("none", tiny, config("none", 100, at_capacity="shift"))
    assert deleted(shift.plan(sm.view(), scores_with(99), {})) == []
    add(sm)
    plan = shift.plan(sm.view(), scores_with(100), {})
    assert deleted(plan) == list(range(4, 4 + 48)) and not plan.stop
    sm.apply(plan.actions + [{"action": "add", "token_id": 42}])
    assert len(sm) == 100 - 48 + 1
    sm.check()


def test_a_budget_without_room_to_evict_is_refused(tiny):
    for cls in (StreamingPolicy, ScoredPolicy, H2OPolicy):
        with pytest.raises(ValueError, match="evictable rows"):
            cls(tiny, config(cls.name, 140, protect=100))


@pytest.mark.parametrize("name,at_capacity", [("streaming", "stop"), ("scored", "stop"), ("h2o", "stop"),
                                              ("none", "shift")])
def test_100_brain_ticks_stay_within_budget_and_consistent(tiny, name, at_capacity):
    cfg = BrainConfig(policy=name, budget=48, sinks=4, protect=6, at_capacity=at_capacity, seed=1)
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)), cfg)
    prefix = brain.state.mirror.live.ledger_ids[:6]
    lengths, deletes = [], 0
    for _ in range(100):
        record = brain.step()
        brain.state.check()
        assert not record.rebuilt and not record.stopped
        assert record.brightness_min == record.brightness_max == 255.0, "these policies keep no brightness"
        lengths.append(record.live_length)
        deletes += sum(a["action"] == "delete" for a in record.actions)
    assert max(lengths) == 48 and deletes > 0
    assert brain.state.mirror.live.ledger_ids[:6] == prefix, "sinks and the protected prefix survive"
    if name != "none":
        assert min(lengths[lengths.index(48):]) == 48 - batch_size(48)
    brain.state.check(deep=True)


@pytest.mark.parametrize("name,every", [("streaming", 1), ("h2o", 5), ("brightness", 3), ("scored", 12)])
def test_evict_every_edits_once_every_n_ticks_freeing_n_rows_and_keeps_the_budget(tiny, name, every):
    """The budget stays hard (live <= budget after every tick) and the policy edits exactly
    on every Nth tick once full, freeing N rows: the live length cycles budget - N + 1 .. budget."""
    cfg = BrainConfig(policy=name, budget=48, evict_every=every, seed=1, **({"window": 8} if name == "brightness" else {}))
    cfg.validate()
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)), cfg)
    edits, lengths = [], []
    for tick in range(120):
        record = brain.step()
        deleted = sum(a["action"] == "delete" for a in record.actions)
        if deleted:
            edits.append((tick, deleted))
        lengths.append(record.live_length)
    assert max(lengths) == 48
    full = lengths.index(48)
    assert min(lengths[full:]) == 48 - every + 1
    assert {count for _, count in edits} == {every}, "N rows each time"
    gaps = {b - a for (a, _), (b, _) in zip(edits, edits[1:])}
    assert gaps == {every}, f"an edit every {every} ticks, not {gaps}"
    brain.state.check(deep=True)


def test_none_stop_ends_the_run_with_the_cache_full(tiny):
    cfg = BrainConfig(policy="none", budget=48, at_capacity="stop", seed=1)
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)), cfg)
    records = []
    result = Runner(brain, tiny.name, 100).run(lambda record, _: records.append(record))
    assert result.stopped and result.ticks == 48 - 21
    assert records[-1].stopped and len(brain.state) == 48
    assert all([a["action"] for a in r.actions] == ["add"] for r in records), "no deletes, only the adds"


@pytest.mark.parametrize("length", [100, 240])  # 240: a quarter of it (llama.cpp's window) is more than the budget
@pytest.mark.parametrize("name", ["brightness", "streaming", "scored", "h2o", "none", "knorm"])
def test_a_prompt_longer_than_the_budget_is_pruned_before_the_first_tick(tiny, name, length):
    prompt = [tiny.bos_id] + [(7 * i) % 500 + 5 for i in range(length - 1)]
    brain = Brain.start(tiny, prompt, BrainConfig(policy=name, budget=48, at_capacity="shift", seed=1))
    sm = brain.state
    assert brain.tick == 0 and len(sm) == 48, "pruned to the budget exactly: the budget is hard"
    assert sm.live_token_ids()[:4] == prompt[:4], "the sinks stay"
    last = sm.mirror.ledger[sm.mirror.live.ledger_ids[-1]]
    assert (last.token_id, last.source, sm.positions()[-1]) == (prompt[-1], "prompt", length - 1), \
        "the prompt's last token, in place"
    assert len(sm.mirror.ledger) == length, "every prompt token is in the ledger, the pruned ones culled"
    assert sm.next_logits is not None
    sm.check(deep=True)
    for _ in range(5):
        assert brain.step().live_length <= 48


class FixedLengthRepairer:
    """Proposes `tokens` copies of the pair's first token: a repairer that frees nothing (2 tokens)
    or grows the context (3)."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def propose(self, view, pair):
        return [int(view.token_ids[pair[0]])] * self.tokens


@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_live_never_exceeds_the_budget_whatever_the_repairer_proposes(tiny, tokens):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48, window=8, seed=1, unit=2))
    brain.policy.repairer = FixedLengthRepairer(tokens)
    for _ in range(60):
        record = brain.step()
        assert record.live_length <= 48
        if tokens > 1:
            assert all(a["action"] != "replace_pair" for a in record.actions), "a repair that frees nothing is a cull"
    assert brain.counts["repairs" if tokens == 1 else "culls"] > 0
    brain.state.check(deep=True)


def test_units_that_cannot_free_enough_are_made_up_by_single_rows(tiny):
    """Brightness takes pairs; when the free rows left are fragmented it deletes single rows."""
    policy = make_policy("brightness", tiny, config("brightness", 20, window=4, repair_batch=8, repairer="none"))
    ids = list(range(100, 120))
    values = [255.0] * 20
    for row in (5, 6, 8, 9, 11, 12, 14, 15):  # four dim pairs in rows 4..15 leave single rows between them
        values[row] = 0.0
    actions, outcomes, gone = policy.free(view_of(ids), values, 9)
    assert sorted(gone) == [4, 5, 6, 8, 9, 11, 12, 14, 15], "four pairs, then the oldest single row"
    assert outcomes[-1] == ((4,), "culled") and len(actions) == 9


@pytest.mark.parametrize("name", ["scored", "h2o"])
def test_a_failed_tick_counts_nothing_in_the_policys_state(tiny, name):
    """A tick that fails did not happen: the policy's per-row state is what it was before it
    (h2o does not accumulate the failed tick's scores and then the retry's on top), and the
    retried tick counts once."""
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)),
                        BrainConfig(policy=name, budget=48, sinks=4, seed=1, temperature=0))
    brain.step()
    while len(brain.state) < 48:  # the next tick is at the budget: it evicts
        brain.step()
    scorer = brain.policy.scorer
    before, clock = dict(scorer.value), scorer.clock
    brain.state.inject_fault("forward")
    record = brain.step()
    assert record.rebuilt and any(a["action"] == "delete" for a in record.actions)
    assert scorer.value == before and scorer.clock == clock
    assert not brain.step().rebuilt and scorer.clock == clock + 1


def test_an_interrupted_plan_is_taken_back(tiny, monkeypatch):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 30)), BrainConfig(policy="h2o", budget=48, seed=1))
    for _ in range(5):
        brain.step()
    before = dict(brain.policy.scorer.value)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(brain.state, "apply", interrupted)
    with pytest.raises(KeyboardInterrupt):
        brain.step()
    assert brain.policy.scorer.value == before and brain.tick == 5


def test_repairs_become_culls_when_the_units_run_out(tiny):
    """Six free pairs, nine rows to free: six one-token repairs free only six, so the latest
    repairs are turned into culls until nine are freed."""
    policy = make_policy("brightness", tiny, config("brightness", 20, window=4, repair_batch=8, unit=2))
    policy.repairer = FixedLengthRepairer(1)
    actions, outcomes, gone = policy.free(view_of(list(range(100, 120))), [0.0] * 20, 9)
    freed = sum(2 - len(a["new_token_ids"]) if a["action"] == "replace_pair" else 1 for a in actions)
    assert freed >= 9 and sorted(gone) == list(range(4, 16))
    assert [outcome for _, outcome in outcomes] == ["replaced"] * 3 + ["culled"] * 3, "the latest repairs go first"


@pytest.mark.parametrize("policy", ["brightness", "streaming", "scored", "h2o", "none"])
def test_pinned_prompt_text_is_never_evicted(tiny, policy):
    prompt = [tiny.bos_id] + tiny.encode("filler text and more filler text, the code is 4817, then filler" * 2)
    cfg = config(policy, 64, at_capacity="shift")
    brain = Brain.start(tiny, prompt, cfg, pins=["4817"])
    ledger = brain.state.mirror.ledger
    pinned = [i for i, e in enumerate(ledger.entries) if e.pinned]
    assert len(pinned) == 8 and "".join(ledger[i].text for i in pinned) == "48174817"
    for _ in range(150):
        brain.step()
        assert all(ledger[i].state == "live" for i in pinned)
    assert ledger.count("culled") > 40, "the policy evicted plenty around the pinned rows"
    brain.state.unpin([row for row, i in enumerate(brain.state.mirror.live.ledger_ids) if i in pinned])
    for _ in range(150):
        brain.step()
    if policy == "streaming":  # the oldest middle rows go first: unpinned, they go
        assert all(ledger[i].state == "culled" for i in pinned)


def test_pins_that_do_not_occur_or_leave_no_room_are_refused(tiny):
    prompt = [tiny.bos_id] + tiny.encode("abc " * 30)
    with pytest.raises(ValueError, match="--pin 'xyz' does not occur in the prompt"):
        Brain.start(tiny, prompt, config("brightness", 64), pins=["xyz"])
    with pytest.raises(ValueError, match="120 pinned rows leave the brightness policy no room to evict at budget 64"):
        Brain.start(tiny, prompt, config("brightness", 64), pins=["abc "])


@pytest.mark.parametrize("name", ["brightness", "scored", "h2o"])
def test_a_plan_changes_nothing_until_it_is_committed(tiny, name):
    """The protocol: `plan` returns the actions and the policy's next state (scorer values,
    recall's lookup with the evicted rows' K/V); the policy is what it was until `commit`, so
    the same tick planned twice is the same plan."""
    policy = make_policy(name, tiny, config(name, 100, recall=True))
    view, scores = state(tiny, 100).view(keys=True), scores_with(100, low=[50, 60])
    before = policy.state()
    first, second = policy.plan(view, scores, {}), policy.plan(view, scores, {})
    assert first.actions == second.actions and len(first.actions) == policy.due(100) and policy.state() == before
    policy.commit(first.next)
    assert policy.state() != before and len(policy.recall) == policy.due(100), "the evicted rows are recallable once committed"


def test_none_stop_refuses_a_prompt_that_leaves_no_room_to_generate(tiny):
    """A prompt of the whole budget under policy none with at_capacity stop: the first tick
    would add a row past the budget (65 at 64), so the start is refused, naming the way out."""
    cfg = BrainConfig(policy="none", budget=48, at_capacity="stop", seed=1)
    with pytest.raises(ValueError, match="fills the budget of 48: policy none with at_capacity stop evicts nothing"):
        Brain.start(tiny, [tiny.bos_id] + list(range(10, 57)), cfg)
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 56)), cfg)  # 47 rows: one token fits
    record = brain.step()
    assert record.stopped and len(brain.state) == 48
