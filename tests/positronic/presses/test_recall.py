"""positronic/presses/recall.py: SmartKV's recall on Core v4 (the smartkv press with recall=True).

A Brain with `smartkv` + recall beside an Engine that took the same started brain: the index
(window-leavers' K/V), the lookups and the tokens each lane takes back are today's. On
random:tiny no indexed token reaches a lane's share threshold (1: as much as all its rows), so
the tests that need returns lower `SmartKVPolicy.recall_share` for both (0.02)."""

import pytest
import torch

from positronic.batch.engine import Engine
from positronic.brain.loop import Brain, BrainConfig
from positronic.smartkv import GateSet
from positronic.smartkv.policy import SmartKVPolicy

TEXT = list(range(3, 60, 3)) * 8  # a text that repeats: later copies look for earlier ones


@pytest.fixture(scope="module")
def gates(tiny, tmp_path_factory):
    """Untrained per-layer gates scaled to trained gates' spread, a 48-step horizon."""
    gates = GateSet.for_config(tiny.model.config, seed=21, per_head=False, header={"lifespan": {"horizon": 48}})
    for gate in gates.gates:
        gate.linear[-1].weight.data.mul_(100.0)
        gate.linear[-1].bias.data.mul_(100.0)
    path = tmp_path_factory.mktemp("gates") / "gates.safetensors"
    gates.save(path)
    return str(path)


def config(gates: str, **extra) -> BrainConfig:
    # Core v4's rounds look in the plan (no reread yet): the Brain they are compared with too
    return BrainConfig(**{**dict(policy="smartkv", recall=True, reread=False, budget=48, temperature=0, seed=3,
                                 gates=gates), **extra})


def restored(engine: Engine, slot: int) -> int:
    return int(engine.state.sequence_state["smartkv.recall.restored"][slot])


def run_beside(lm, cfg, ids, rounds):
    brain = Brain.start(lm, ids, cfg)
    engine = Engine(lm, slots=2, capacity=cfg.budget, score_layers=cfg.recorded_layers)
    engine.join("a", Brain.start(lm, ids, cfg))
    for number in range(rounds):
        assert engine.step() == {"a": brain.step().token_id}, f"round {number}"
        assert restored(engine, 0) == brain.policy.recall.restored, f"round {number}"
        assert engine.state.mirror(0).layers.rows == brain.state.mirror.layers.rows, f"round {number}"
    return engine, brain


def test_the_index_is_todays_and_the_tokens_too(tiny, gates):
    """The shipped threshold: 80 rounds past the budget, the index holds today's tokens in
    today's ring slots, and the tokens and every lane's rows are the Brain's."""
    cfg = config(gates)
    engine, brain = run_beside(tiny, cfg, [tiny.bos_id] + TEXT[:70], 80)
    recall, state = brain.policy.recall, engine.state.sequence_state
    count = int(state["smartkv.recall.count"][0])
    assert count == len(recall.ids) > 0 and int(state["smartkv.recall.next"][0]) == recall.next
    assert state["smartkv.recall.positions"][0, :count].tolist() == recall.positions
    assert int(state["smartkv.recall.clock"][0]) == recall.clock
    keys = state["smartkv.recall.keys"][0, :, :, :count]  # [layers, kv_heads, rows, head_dim]
    torch.testing.assert_close(keys, recall.keys[..., :count].transpose(2, 3), rtol=0, atol=1e-5)


def test_tokens_come_back_into_the_lanes_todays_recall_names(tiny, gates, monkeypatch):
    """A low threshold: tokens come back every round (restores happen), into the lanes and in
    place of the rows today's recall names, with the Brain's tokens, for 50 rounds: past the
    point where every memory row of a lane is held and rows taken back together share their
    age, so their ties go as today's memory breaks them, by its slot order (the press's `slot`)."""
    monkeypatch.setattr(SmartKVPolicy, "recall_share", 0.02)
    cfg = config(gates)
    engine, brain = run_beside(tiny, cfg, [tiny.bos_id] + TEXT[:70], 50)
    assert brain.policy.recall.restored >= 50 and restored(engine, 0) == brain.policy.recall.restored
    slot = engine.state.row_state["smartkv.slot"][0]  # [lanes, capacity]: each memory row's place today
    memory = brain.policy.memory
    for lane, ids in enumerate(engine.state.mirror(0).layers.rows):
        places = {int(i): k for k, i in enumerate(memory.ids[lane, : memory.count])}
        assert [int(slot[lane, row]) for row, i in enumerate(ids) if i in places] == \
            [places[i] for i in ids if i in places]
    mirror = engine.state.mirror(0)
    mirror.check(tiny.max_positions)
    assert [e.state for e in mirror.ledger.entries] == [e.state for e in brain.state.mirror.ledger.entries]


def test_three_sequences_batched_make_what_each_makes_alone(tiny, gates, monkeypatch):
    """B = 3 recall sequences (two ranks, joining at different rounds) with returns: each makes
    the tokens and the lanes' rows it makes in an engine alone, for 40 rounds."""
    monkeypatch.setattr(SmartKVPolicy, "recall_share", 0.02)
    plans = [("gates", 0, 0), ("recent", 7, 3), ("gates", 13, 6)]  # rank, prompt offset, round it joins

    def start(k):
        rank, offset, _ = plans[k]
        return Brain.start(tiny, [tiny.bos_id] + TEXT[offset : offset + 60], config(gates, memory_rank=rank, seed=k))

    engine = Engine(tiny, slots=3, capacity=48, score_layers="all")
    made = {k: [] for k in range(3)}
    for number in range(40):
        for k, (_, _, joins) in enumerate(plans):
            if number == joins:
                engine.join(k, start(k))
        for k, token in engine.step().items():
            made[k].append(token)
    together = {k: engine.state.mirror(engine.keys().index(k)).layers.rows for k in range(3)}
    for k in range(3):
        alone = Engine(tiny, slots=1, capacity=48, score_layers="all")
        alone.join(k, start(k))
        assert [alone.step()[k] for _ in made[k]] == made[k], f"sequence {k}"
        assert alone.state.mirror(0).layers.rows == together[k]
        assert restored(alone, 0) > 0


def test_the_embedded_model_with_recall_makes_todays_tokens(smol, monkeypatch):
    """SmolLM2, its shipped per-head gates (90 lanes), a repeating prompt, 24 rounds."""
    monkeypatch.setattr(SmartKVPolicy, "recall_share", 0.3)
    cfg = BrainConfig(policy="smartkv", recall=True, reread=False, budget=64, temperature=0)
    ids = [smol.bos_id] + smol.encode("The code is 7 4 1 9. The quick brown fox jumps over the lazy dog. " * 6)
    brain = Brain.start(smol, ids, cfg)
    engine = Engine(smol, slots=1, capacity=64, score_layers=cfg.recorded_layers)
    engine.join(0, Brain.start(smol, ids, cfg))
    assert [engine.step()[0] for _ in range(24)] == [brain.step().token_id for _ in range(24)]
    assert restored(engine, 0) == brain.policy.recall.restored > 0  # 6 tokens came back (3 at the shipped 1.0)
    assert engine.state.mirror(0).layers.rows == brain.state.mirror.layers.rows


def test_a_lane_taking_back_a_token_it_holds_is_refused_and_nothing_changes(tiny, gates):
    from positronic.state.slots import Inserts
    engine = Engine(tiny, slots=1, capacity=48, score_layers="all")
    engine.join(0, Brain.start(tiny, [tiny.bos_id] + TEXT[:70], config(gates)))
    state = engine.state
    before = (state.positions.clone(), state.kv.keys.clone(), int(state.length[0]))
    lanes, layers, kv, dim = state.lanes, tiny.num_layers, tiny.num_kv_heads, tiny.head_dim
    deleted = torch.zeros((1, lanes, 48), dtype=torch.bool)
    deleted[0, :, 10] = True
    held = int(state.positions[0, 0, 5])
    inserts = Inserts(torch.ones((1, lanes, 1), dtype=torch.bool), torch.tensor([[held]]), torch.tensor([[7]]),
                      torch.zeros((1, 1, layers, kv, dim)), torch.zeros((1, 1, layers, kv, dim)))
    with pytest.raises(ValueError, match="which it holds"):
        state.apply(deleted, [5], inserts=inserts)
    assert torch.equal(state.positions, before[0]) and torch.equal(state.kv.keys, before[1])
    assert int(state.length[0]) == before[2]


def test_a_sequence_taking_tokens_back_is_handed_back_and_goes_on_as_its_brain(tiny, gates, monkeypatch):
    """Returns every round (a low threshold): 10 ticks alone, 40 rounds, 20 alone, 20 rounds, 10
    alone make a lone Brain's 100 tokens, lanes, restores and index, and each lane's memory in
    the slots the lone Brain's keeps it (ties among rows held or taken back together go by them)."""
    from tests.positronic.batch.test_engine import in_and_out

    monkeypatch.setattr(SmartKVPolicy, "recall_share", 0.02)
    cfg = config(gates)
    ids = [tiny.bos_id] + TEXT[:70]
    want = Brain.start(tiny, ids, cfg)
    expected = [want.step().token_id for _ in range(100)]
    brain = Brain.start(tiny, ids, cfg)
    engine = Engine(tiny, slots=2, capacity=cfg.budget, score_layers=cfg.recorded_layers, lanes=tiny.num_layers)
    assert in_and_out(engine, brain, lambda: Brain.start(tiny, [tiny.bos_id] + TEXT[5:60], cfg)) == expected
    assert brain.state.mirror.layers.rows == want.state.mirror.layers.rows
    mine, theirs = brain.policy.memory, want.policy.memory
    assert (mine.ids == theirs.ids).all() and (mine.until == theirs.until).all()
    assert brain.policy.recall.restored == want.policy.recall.restored > 100
    assert brain.policy.recall.ids == want.policy.recall.ids
    assert brain.policy.recall.lane_back_at == want.policy.recall.lane_back_at
    brain.state.check(deep=True)
