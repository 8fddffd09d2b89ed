"""positronic/presses/smartkv.py: SmartKV as a press over lanes makes today's tokens and rows.

Each case runs a Brain with `--policy smartkv` (positronic/smartkv/policy.py) beside an Engine
that took the same started brain: every round's token, and in the end every lane's rows (the
folded mirror's per-layer rows), the live map, positions and ledger are the Brain's. Lanes are
layers (per-layer gates) or kv heads of layers (per-head gates); memories rank by the gates or
by the gates and recent use."""

import dataclasses
import random

import numpy as np
import pytest
import torch

from positronic.batch.engine import Engine
from positronic.brain.loop import Brain, BrainConfig
from positronic.presses import Rows, SmartKVPress, make_press
from positronic.smartkv import GateSet
from positronic.smartkv.recent import RecentMemories
from positronic.smartkv.rows import Memories
from tests.positronic.batch.test_engine import in_and_out

TEXT = list(range(3, 240, 3)) + list(range(7, 200, 5))  # 119 ids, repeats within the penalty window


def spread_gates(lm, path, *, per_head: bool) -> str:
    """Untrained gates with their outputs scaled to trained gates' spread (~1) and a 48-step
    horizon: within a test's few dozen tokens scores and ages both decide what memory keeps."""
    gates = GateSet.for_config(lm.model.config, seed=21, per_head=per_head, header={"lifespan": {"horizon": 48}})
    for gate in gates.gates:
        gate.linear[-1].weight.data.mul_(100.0)
        gate.linear[-1].bias.data.mul_(100.0)
    gates.save(path)
    return str(path)


@pytest.fixture(scope="module", params=["per layer", "per head"])
def gate_file(request, tiny, tmp_path_factory):
    per_head = request.param == "per head"
    return spread_gates(tiny, tmp_path_factory.mktemp("gates") / f"{request.param}.safetensors", per_head=per_head)


def config(gates: str, **extra) -> BrainConfig:
    return BrainConfig(**{**dict(policy="smartkv", budget=48, temperature=0, seed=3, gates=gates), **extra})


def prompt(lm, offset: int, length: int) -> list[int]:
    return [lm.bos_id] + TEXT[offset : offset + length]


def assert_same_rows(engine: Engine, slot: int, brain: Brain, lm) -> None:
    mirror, today = engine.state.mirror(slot), brain.state.mirror
    assert mirror.layers.rows == today.layers.rows  # every lane's own rows
    assert mirror.live_token_ids() == today.live_token_ids() and mirror.positions() == today.positions()
    assert [e.state for e in mirror.ledger.entries] == [e.state for e in today.ledger.entries]
    mirror.check(lm.max_positions)


@pytest.mark.parametrize("rank", ["gates", "recent"])
def test_the_engine_makes_todays_tokens_and_rows(tiny, gate_file, rank):
    """60 rounds past the budget (every lane drops a row each round) from a prompt pruned at
    the start: the tokens each round and every lane's rows every 10 rounds are the Brain's."""
    cfg = config(gate_file, memory_rank=rank)
    brain = Brain.start(tiny, prompt(tiny, 0, 70), cfg)
    engine = Engine(tiny, slots=2, capacity=cfg.budget, score_layers=cfg.recorded_layers)
    engine.join("a", Brain.start(tiny, prompt(tiny, 0, 70), cfg))
    assert engine.state.lanes == brain.state.lanes == tiny.num_layers * brain.policy.heads
    for number in range(60):
        assert engine.step() == {"a": brain.step().token_id}
        if number % 10 == 9:
            assert_same_rows(engine, 0, brain, tiny)


@pytest.mark.parametrize("length", [10, 30, 47])
def test_a_short_prompt_fills_the_window_and_memory_as_today(tiny, gate_file, length):
    """Prompts under the budget: the window fills first (10), or the first tick offers every
    token past it at once (30: into a memory with room; 47: it fills, the last offer drops)."""
    cfg = config(gate_file, memory_rank="recent")
    brain = Brain.start(tiny, prompt(tiny, 5, length), cfg)
    engine = Engine(tiny, slots=1, capacity=cfg.budget, score_layers=cfg.recorded_layers)
    engine.join(0, Brain.start(tiny, prompt(tiny, 5, length), cfg))
    for _ in range(40):
        assert engine.step()[0] == brain.step().token_id
    assert_same_rows(engine, 0, brain, tiny)


def test_three_sequences_batched_make_what_each_brain_makes_alone(tiny, gate_file):
    """B = 3 smartkv sequences (two of one rank, one of the other) and a streaming one sharing
    the lanes state, joining at different rounds: each makes its own Brain's tokens and rows."""
    plans = [("recent", 0, 0), ("gates", 9, 4), ("recent", 21, 11)]  # rank, prompt offset, round it joins
    configs = [config(gate_file, memory_rank=rank, seed=k) for k, (rank, _, _) in enumerate(plans)]
    plans.append(("streaming", 40, 2))
    configs.append(BrainConfig(policy="streaming", budget=40, temperature=0))
    brains = {k: Brain.start(tiny, prompt(tiny, offset, 60), cfg) for k, (cfg, (_, offset, _)) in enumerate(zip(configs, plans))}
    engine = Engine(tiny, slots=4, capacity=48, score_layers="all")
    made, wanted = {k: [] for k in brains}, {k: [] for k in brains}
    for number in range(50):
        for k, (cfg, (_, offset, joins)) in enumerate(zip(configs, plans)):
            if number == joins:
                engine.join(k, Brain.start(tiny, prompt(tiny, offset, 60), cfg))
        for k, token in engine.step().items():
            made[k].append(token)
            wanted[k].append(brains[k].step().token_id)
    assert made == wanted
    for k in range(3):
        assert_same_rows(engine, engine.keys().index(k), brains[k], tiny)


@pytest.mark.parametrize("rank", ["gates", "recent"])
def test_the_embedded_model_with_its_shipped_gates_makes_todays_tokens(smol, rank):
    cfg = BrainConfig(policy="smartkv", budget=64, temperature=0, memory_rank=rank)
    ids = [smol.bos_id] + smol.encode("The quick brown fox jumps over the lazy dog. " * 12)
    brain = Brain.start(smol, ids, cfg)
    engine = Engine(smol, slots=1, capacity=64, score_layers=cfg.recorded_layers)
    engine.join(0, Brain.start(smol, ids, cfg))
    assert engine.state.lanes == smol.num_layers * smol.num_kv_heads  # the shipped gates keep rows per kv head
    assert [engine.step()[0] for _ in range(24)] == [brain.step().token_id for _ in range(24)]
    assert_same_rows(engine, 0, brain, smol)


@pytest.mark.parametrize("rank", ["gates", "recent"])
def test_each_lane_drops_what_todays_memory_drops_ties_to_the_older(tiny, gate_file, rank):
    """Crafted full memories (scores from a few values, many rows past the horizon: equal ranks),
    in shuffled slots: every lane of every sequence drops the row `Memories.offer` (or
    `RecentMemories.offer`, with its sums) drops when the window's oldest row is offered."""
    keep, window, size, rng = 2, 4, 8, random.Random(5)
    press = make_press("smartkv", dict(budget=keep + size + window, sinks=keep, window=window, gates=gate_file,
                                       memory_rank=rank))
    press.bind(tiny)
    lanes, sequences, length = press.lanes, 24, keep + size + window
    positions = torch.zeros((sequences, lanes, 16), dtype=torch.long)
    weight, used = torch.zeros((sequences, lanes, 16), dtype=torch.float64), torch.zeros((sequences, lanes, 16),
                                                                                          dtype=torch.float64)
    wanted = torch.zeros((sequences, lanes, 16), dtype=torch.bool)
    for s in range(sequences):
        memory = (RecentMemories if rank == "recent" else Memories)(lanes, size, press.horizon)
        leaving = [rng.choice([-1.0, 0.0, 0.5]) for _ in range(lanes)]
        memory.window_ids, memory.window_used = np.array([keep + size]), np.zeros((lanes, 1))
        for lane in range(lanes):
            held = sorted(rng.sample(range(keep, 80), size))  # now - horizon = 56: most are past it
            scores = [rng.choice([-1.0, 0.0, 0.5, 3.0]) for _ in held]
            sums = [rng.choice([0.0, 0.5, 1.5]) for _ in held]
            positions[s, lane, :length] = torch.tensor([0, 1, *held, 100, 101, 102, 103])
            weight[s, lane, keep : keep + size + 1] = torch.tensor([4.0 ** x for x in scores + [leaving[lane]]])
            used[s, lane, keep : keep + size + 1] = torch.tensor(sums + [0.25 * lane])
            memory.window_used[lane, 0] = 0.25 * lane
            for slot, k in enumerate(rng.sample(range(size), size)):  # slots in any order
                memory.scores[lane, slot], memory.weights[lane, slot] = scores[k], 4.0 ** scores[k]
                memory.positions[lane, slot], memory.ids[lane, slot] = held[k], keep + k
                if rank == "recent":
                    memory.used[lane, slot] = sums[k]
        memory.count = size
        dropped = memory.offer(keep + size, 100, leaving, now=100 + window)  # ids: rows
        wanted[s, torch.arange(lanes), torch.from_numpy(dropped)] = True
    rows = Rows(length=torch.full((sequences,), length), positions=positions[:, 0],
                shares=torch.zeros((sequences, 16)), pinned=torch.zeros((sequences, 16), dtype=torch.bool),
                lane_positions=positions, lane_peaks=torch.zeros((sequences, lanes, 16)))  # no shares: sums as they are
    plan = press.plan(rows, {"weight": weight} | ({"used": used} if rank == "recent" else {}), torch.zeros(sequences))
    assert torch.equal(plan.deleted, wanted)


def test_past_the_position_limit_every_lane_is_packed_and_re_rotated(tiny, gate_file, layer0_oracle):
    """With 80 positions the union's rows are packed down (each lane's keys re-rotated): until
    then the tokens are the Brain's; after it every round still goes through, and each lane of
    layer 0 holds its tokens' keys at their packed positions, as a fresh prefill gives them.
    (Today's policy keeps the positions its memories had before a pack, so its ages jump there:
    the press ranks by the packed positions, and the two part ways a few rounds after.)"""
    lm = dataclasses.replace(tiny, max_positions=80)
    cfg = config(gate_file)
    brain = Brain.start(lm, prompt(lm, 0, 30), cfg)
    engine = Engine(lm, slots=1, capacity=48, score_layers=cfg.recorded_layers)
    engine.join(0, Brain.start(lm, prompt(lm, 0, 30), cfg))
    packed = False
    for _ in range(70):
        token = engine.step()[0]  # KeyError if the round failed
        packed = packed or brain.state.mirror.positions()[-1] < len(brain.state.mirror.ledger) - 1
        if not packed:
            assert token == brain.step().token_id
    assert packed
    mirror, (keys, _) = engine.state.mirror(0), engine.state.rows(0)
    mirror.check(lm.max_positions)
    heads = engine.state.lanes // lm.num_layers
    where = dict(zip(mirror.live.ledger_ids, mirror.live.positions))
    for head in range(heads):  # layer 0's lanes (with a lane per layer, the layer's every kv head)
        ids = mirror.layers.rows[head]
        expected, _ = layer0_oracle(lm, [mirror.ledger[i].token_id for i in ids], [where[i] for i in ids])
        part = slice(None) if heads == 1 else slice(head, head + 1)
        torch.testing.assert_close(keys[0, part], expected[0, part], rtol=0, atol=1e-4)


def test_a_round_drops_one_row_per_lane_once_the_memory_is_full(tiny, gate_file):
    """The plan itself: none while the memory has room, then exactly one row in every lane,
    never a kept row nor a window row; the leaving row is scored, the rest keep their weights."""
    cfg = config(gate_file, budget=40, sinks=2, window=12)
    engine = Engine(tiny, slots=1, capacity=40, score_layers=cfg.recorded_layers)
    engine.join(0, Brain.start(tiny, prompt(tiny, 0, 15), cfg))
    press, state = engine.sequences[0].press, engine.state
    for _ in range(30):
        length, keep = int(state.length[0]), 2
        rows = Rows(length=state.length[:1], positions=state.positions[:1, 0], shares=state.shares[:1],
                    pinned=state.row_state["pinned"][:1], lane_positions=state.positions[:1], read=state.read)
        before = state.row_state["smartkv.weight"][:1]
        plan = press.plan(rows, {"weight": before}, torch.zeros(1, dtype=torch.long))
        dropped = plan.deleted[0].nonzero()
        if length < cfg.budget:
            assert len(dropped) == 0
        else:
            assert dropped[:, 0].tolist() == list(range(press.lanes))  # one row in every lane
            assert ((dropped[:, 1] >= keep) & (dropped[:, 1] <= length - 12)).all()  # memory or the leaving row
        leaving, before, after = length - 12, before[0], plan.next["weight"][0]
        assert torch.equal(after[before > 0], before[before > 0])
        assert (after[:, keep : leaving + 1] > 0).all() and torch.equal(after[:, leaving + 1 :], before[:, leaving + 1 :])
        engine.step()


def test_the_carried_state_is_todays_memories_and_scores(tiny, gate_file):
    """At a join the press takes, at every lane's rows, the weights (4 ** score) and recent-use
    sums of the policy's memories, and the window's scores and sums where it has them."""
    cfg = config(gate_file, memory_rank="recent")
    brain = Brain.start(tiny, prompt(tiny, 0, 70), cfg)
    for _ in range(7):
        brain.step()
    press = make_press("smartkv", cfg)
    press.bind(tiny, brain.policy)
    carried = press.carry(brain.policy, brain.state.mirror)
    memory, lanes = brain.policy.memory, brain.state.mirror.layers.rows
    for lane, ids in enumerate(lanes):
        for row, ledger_id in enumerate(ids[press.keep : press.keep + memory.count], start=press.keep):
            slot = list(memory.ids[lane, : memory.count]).index(ledger_id)
            assert carried["weight"][lane, row] == memory.weights[lane, slot]
            assert carried["used"][lane, row] == memory.used[lane, slot]
        for row, ledger_id in enumerate(ids[-cfg.window :], start=len(ids) - cfg.window):
            scores = brain.policy.scores.get(ledger_id)
            assert carried["weight"][lane, row] == (0.0 if scores is None else 4.0 ** scores[lane])
            counted = list(memory.window_ids)  # the newest token is counted from the next tick on
            assert carried["used"][lane, row] == (memory.window_used[lane, counted.index(ledger_id)]
                                                  if ledger_id in counted else 0.0)
    assert (carried["weight"][:, press.keep : press.keep + memory.count] > 0).all()
    assert np.count_nonzero(carried["weight"][:, -cfg.window :].numpy()) > 0  # some window tokens scored already


def test_what_does_not_run_on_the_press_yet_is_refused_with_the_reason(tiny, gate_file):
    with pytest.raises(ValueError, match="press smartkv ranks by every layer's attention: make the engine with "
                                         "score_layers='all'"):  # recall reads every layer's query
        Engine(tiny, slots=1, capacity=48).join(0, Brain.start(tiny, prompt(tiny, 0, 20),
                                                               config(gate_file, recall=True, reread=False)))
    pinned = Brain.start(tiny, prompt(tiny, 0, 20), config(gate_file))
    pinned.state.pin([5])
    with pytest.raises(ValueError, match="smartkv with pinned rows does not run on Core v4 yet"):
        Engine(tiny, slots=1, capacity=48).join(0, pinned)
    engine = Engine(tiny, slots=2, capacity=48, lanes=1)
    with pytest.raises(ValueError, match=r"press smartkv keeps rows in \d+ lanes and this engine in 1: make the "
                                         r"engine with lanes=\d+"):
        engine.join(0, Brain.start(tiny, prompt(tiny, 0, 20), config(gate_file)))
    with pytest.raises(ValueError, match="press smartkv ranks by every layer's attention: make the engine with "
                                         "score_layers='all'"):
        Engine(tiny, slots=1, capacity=48).join(0, Brain.start(tiny, prompt(tiny, 0, 20),
                                                               config(gate_file, memory_rank="recent")))
    shared = Engine(tiny, slots=2, capacity=48)
    shared.join("h", Brain.start(tiny, prompt(tiny, 0, 20), BrainConfig(policy="h2o", budget=48, temperature=0)))
    with pytest.raises(ValueError, match="make the engine with lanes="):
        shared.join(0, Brain.start(tiny, prompt(tiny, 0, 20), config(gate_file)))
    assert len(engine) == 0 and shared.keys() == ["h"]
    with pytest.raises(ValueError, match="leaves no long-term memory"):
        SmartKVPress(dict(budget=20, sinks=4, window=16))
    with pytest.raises(ValueError, match="memory_rank must be one of"):
        SmartKVPress(dict(budget=48, window=24, memory_rank="often"))


@pytest.mark.parametrize("extra", [dict(memory_rank="gates"), dict(memory_rank="recent"),
                                   dict(recall=True, reread=False)],
                         ids=["gates", "recent", "recall"])
def test_a_sequence_handed_back_ticks_on_as_if_it_had_never_left_its_brain(tiny, gate_file, extra):
    """10 ticks alone, 40 rounds, 20 alone, 20 rounds, 10 alone (another smartkv sequence ticking
    in the vacated slot between): the tokens and every lane's rows of a Brain that made every tick
    itself, and its policy's memories (each lane's tokens, ages, holds, weights; the recent-use
    sums to the last bits of a share), the token last offered and recall's index."""
    cfg = config(gate_file, **extra)
    want = Brain.start(tiny, prompt(tiny, 0, 60), cfg)
    expected = [want.step().token_id for _ in range(100)]
    brain = Brain.start(tiny, prompt(tiny, 0, 60), cfg)
    lanes = len(brain.state.mirror.layers.rows)
    engine = Engine(tiny, slots=2, capacity=64, score_layers=cfg.recorded_layers, lanes=lanes)
    assert in_and_out(engine, brain, lambda: Brain.start(tiny, prompt(tiny, 20, 45), cfg)) == expected
    assert brain.state.mirror.layers.rows == want.state.mirror.layers.rows
    assert brain.tick == want.tick and brain.policy.offered == want.policy.offered
    mine, theirs = brain.policy.memory, want.policy.memory
    assert mine.count == theirs.count
    for lane in range(mine.layers):  # the same tokens, whatever slot order each memory keeps them in
        held = {int(i): k for k, i in enumerate(theirs.ids[lane, : theirs.count])}
        order = [held[int(i)] for i in mine.ids[lane, : mine.count]]
        for name in ("positions", "until", "weights"):
            np.testing.assert_allclose(getattr(mine, name)[lane, : mine.count], getattr(theirs, name)[lane, order],
                                       rtol=1e-5)
        if theirs.watches:
            np.testing.assert_allclose(mine.used[lane, : mine.count], theirs.used[lane, order], rtol=1e-4, atol=1e-6)
    if cfg.recall:
        assert brain.policy.recall.ids == want.policy.recall.ids and brain.policy.recall.clock == want.policy.recall.clock
    brain.state.check(deep=True)
