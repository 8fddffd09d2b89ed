"""Core v4's engine (positronic/batch/engine.py): every sequence's tick as one batched round.
Each press makes the tokens today's Brain makes; batched sequences make what they make alone."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch

from positronic.batch.engine import Engine, union_recent
from positronic.brain.loop import Brain, BrainConfig
from positronic.presses import Press, Settings
from positronic.state.manager import StateManager
from positronic.smartkv.gates import bench_gates
from positronic.util import TorchOps

PRESSES = ["streaming", "h2o", "scored", "brightness", "random", "none", "knorm"]  # knorm: a press without a policy of its own
TEXT = list(range(3, 240, 3)) + list(range(7, 200, 5))  # 119 ids, repeats within the penalty window


def config_for(policy: str, **extra) -> BrainConfig:
    settings = dict(policy=policy, budget=48, temperature=0, seed=3)
    if policy == "none":
        settings["at_capacity"] = "shift"
    return BrainConfig(**{**settings, **extra})


def prompt(lm, offset: int, length: int) -> list[int]:
    return [lm.bos_id] + TEXT[offset : offset + length]


@pytest.mark.parametrize("policy", PRESSES)
def test_each_press_makes_todays_tokens(tiny, policy):
    """60 ticks past the budget (every press edits): the engine's tokens, live rows and
    positions are those of today's Brain with the policy of the same name."""
    config = config_for(policy)
    brain = Brain.start(tiny, prompt(tiny, 0, 70), config)
    engine = Engine(tiny, slots=2, capacity=config.budget, score_layers=config.recorded_layers)
    engine.join("a", Brain.start(tiny, prompt(tiny, 0, 70), config))
    for _ in range(60):
        assert engine.step() == {"a": brain.step().token_id}
    mirror = engine.state.mirror(0)
    assert mirror.live_token_ids() == brain.state.mirror.live_token_ids()
    assert mirror.positions() == brain.state.mirror.positions()
    assert len(mirror.ledger) == len(brain.state.mirror.ledger)
    assert [e.state for e in mirror.ledger.entries] == [e.state for e in brain.state.mirror.ledger.entries]
    mirror.check(tiny.max_positions)


@pytest.mark.parametrize("policy,every", [("h2o", 1), ("scored", 6), ("brightness", 3)])
def test_editing_every_n_rounds_makes_todays_tokens(tiny, policy, every):
    """evict_every reaches the press by name (Settings.of) and the rounds edit when the Brain does."""
    config = config_for(policy, evict_every=every)
    brain = Brain.start(tiny, prompt(tiny, 0, 40), config)
    engine = Engine(tiny, slots=2, capacity=config.budget, score_layers=config.recorded_layers)
    engine.join("a", Brain.start(tiny, prompt(tiny, 0, 40), config))
    assert engine.sequences[0].press.batch() == every
    lengths = []
    for _ in range(40):
        assert engine.step() == {"a": brain.step().token_id}
        lengths.append(int(engine.state.length[0]))
    assert engine.state.mirror(0).live_token_ids() == brain.state.mirror.live_token_ids()
    assert min(lengths[lengths.index(config.budget):]) == config.budget - every + 1


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_the_embedded_model_makes_todays_tokens(smol, policy):
    config = config_for(policy, budget=64)
    ids = smol.encode("The quick brown fox jumps over the lazy dog. " * 12)
    brain = Brain.start(smol, [smol.bos_id] + ids, config)
    engine = Engine(smol, slots=1, capacity=64, score_layers=config.recorded_layers)
    engine.join(0, Brain.start(smol, [smol.bos_id] + ids, config))
    assert [engine.step()[0] for _ in range(24)] == [brain.step().token_id for _ in range(24)]


def alone(lm, policy: str, offset: int, rounds: int, **extra) -> list[int]:
    config = config_for(policy, **extra)
    engine = Engine(lm, slots=1, capacity=64, score_layers=config.recorded_layers)
    engine.join("x", Brain.start(lm, prompt(lm, offset, 50 + offset % 17), config))
    return [engine.step()["x"] for _ in range(rounds)]


@pytest.mark.parametrize("size", [3, 8])
def test_batched_sequences_make_their_alone_tokens_as_they_join_and_leave(tiny, size):
    """B sequences of mixed presses, budgets and samplers (greedy and seeded sampling) join and
    leave at random rounds: each makes, token for token, what it makes in an engine alone."""
    rng = random.Random(size)
    plans = []
    for k in range(size):
        policy = PRESSES[k % len(PRESSES)]
        extra = dict(budget=rng.choice([40, 48, 56]), seed=k)
        if k % 3 == 1:
            extra.update(temperature=0.8, top_k=20)
        joins = rng.randrange(0, 10)
        plans.append((k, policy, 5 * k, joins, joins + rng.randrange(8, 30), extra))
    engine = Engine(tiny, slots=size, capacity=64, score_layers="last")
    made = {k: [] for k, *_ in plans}
    for number in range(45):
        for k, policy, offset, joins, leaves, extra in plans:
            if number == joins:
                config = config_for(policy, **extra)
                engine.join(k, Brain.start(tiny, prompt(tiny, offset, 50 + offset % 17), config))
            if number == leaves and k in engine.keys():
                engine.leave(k)
        for k, token in engine.step().items():
            made[k].append(token)
    for k, policy, offset, joins, leaves, extra in plans:
        assert made[k] == alone(tiny, policy, offset, len(made[k]), **extra), f"sequence {k} ({policy})"


def test_smartkv_sequences_run_beside_shared_rows_and_make_their_brains_tokens(tiny, tmp_path):
    """An engine of a lane per layer: smartkv sequences (greedy, sampling, two budgets) beside
    h2o and streaming ones (every lane alike), joining and leaving at different rounds: each
    makes its own Brain's tokens, and a smartkv sequence's penalties look at the union of its
    lanes' rows, the last tokens of its mirror's live map."""
    _, gates = bench_gates(tiny, tmp_path)
    plans = [("smartkv", {}, 0, 45), ("h2o", {}, 0, 30), ("smartkv", dict(temperature=0.8, top_k=20), 3, 45),
             ("streaming", {}, 6, 45), ("smartkv", dict(budget=56, seed=9), 12, 40)]  # policy, settings, joins, leaves
    configs = [config_for(policy, **({"gates": gates} if policy == "smartkv" else {}), **extra)
               for policy, extra, _, _ in plans]
    brains = {k: Brain.start(tiny, prompt(tiny, 7 * k, 60), cfg) for k, cfg in enumerate(configs)}
    engine = Engine(tiny, slots=5, capacity=64, lanes=tiny.num_layers)
    made, wanted = {k: [] for k in brains}, {k: [] for k in brains}
    for number in range(45):
        for k, (_, _, joins, leaves) in enumerate(plans):
            if number == joins:
                engine.join(k, Brain.start(tiny, prompt(tiny, 7 * k, 60), configs[k]))
            if number == leaves:
                engine.leave(k)
        for k, token in engine.step().items():
            made[k].append(token)
            wanted[k].append(brains[k].step().token_id)
        for k in (0, 2, 4):
            if k in engine.keys():
                slot = engine.keys().index(k)
                for window in (5, 40, 64):
                    ids, newest = union_recent(engine.state, torch.tensor([slot]), window)
                    assert ids[0][newest[0]].flip(0).tolist() == engine.state.mirror(slot).live_token_ids()[-window:]
    assert made == wanted and all(len(tokens) > 25 for tokens in made.values())
    assert engine.state.mirror(engine.keys().index(0)).layers.rows == brains[0].state.mirror.layers.rows


@dataclass(frozen=True)
class NewestSettings(Settings):
    spare: int = 0  # rows at the end, besides the press's window, never selected


class NewestFirst(Press):
    """A press written in one file, here: the newest middle rows go first (the reverse of
    streaming), `spare` extra rows at the end kept."""

    name = "newest-first"
    Settings = NewestSettings

    def window(self, length):
        return super().window(length) + self.settings.spare

    def score(self, rows, state, clock):
        return -rows.positions.double(), {}


def test_a_press_written_in_one_file_runs_with_its_own_setting(tiny):
    """The press's settings come from BrainConfig's fields by name (budget, sinks) and its own
    default (`spare`); rounds past the budget evict the newest selectable rows."""
    config = config_for("streaming")
    engine = Engine(tiny, slots=1, capacity=48)
    press = NewestFirst(NewestSettings(budget=48, spare=2))
    engine.join("n", Brain.start(tiny, prompt(tiny, 0, 70), config), press=press)
    before = engine.state.mirror(0).live.ledger_ids
    engine.step()
    mirror = engine.state.mirror(0)
    gone = [i for i in before if i not in mirror.live.ledger_ids]
    window = int(press.window(torch.tensor([48]))[0])
    assert gone == before[48 - window - press.batch() : 48 - window]


def test_settings_that_do_not_run_on_core_v4_are_refused_by_name(tiny, tmp_path):
    engine = Engine(tiny, slots=2, capacity=48)
    for extra, name in ((dict(recall=True), "recall"), (dict(kv_format="int4"), "kv_format"),
                        (dict(policy="brightness", repairer="self"), "repairer"),
                        (dict(policy="smartkv", recall=True, gates=bench_gates(tiny, tmp_path)[1]), "reread")):
        brain = Brain.start(tiny, prompt(tiny, 0, 20), config_for(extra.pop("policy", "h2o"), **extra))
        with pytest.raises(ValueError, match=f"{name}=.* does not run on Core v4 yet"):
            engine.join("x", brain)
    with pytest.raises(ValueError, match="budget 64 does not fit the engine's 48 rows"):
        engine.join("x", Brain.start(tiny, prompt(tiny, 0, 20), config_for("h2o", budget=64)))
    over = Brain(StateManager.from_tokens(tiny, prompt(tiny, 0, 60)), config_for("h2o"))  # made by hand, 61 rows
    with pytest.raises(ValueError, match="its 61 live rows do not fit the engine's 48 rows"):
        engine.join("x", over)
    assert len(engine) == 0


def test_policy_none_with_stop_makes_its_last_token_and_leaves(tiny):
    config = config_for("none", at_capacity="stop", budget=40)
    engine = Engine(tiny, slots=1, capacity=40)
    engine.join("s", Brain.start(tiny, prompt(tiny, 0, 30), config))
    rounds = 0
    while len(engine):
        engine.step()
        rounds += 1
    assert rounds == 9 and len(engine.finished["s"]) == 40  # 31 rows, 9 tokens: the cache exactly full


@pytest.mark.parametrize("plain", [True, False])
def test_logits_that_are_not_finite_rebuild_that_sequence_and_it_goes_on(tiny, plain):
    """A forward that leaves a garbage row (NaN logits) has that sequence rebuilt from the mirror
    before it samples, as a Brain does: it makes the tokens of an undisturbed run. Plain rounds
    check the logits their forward made in the round's one wait; full rounds before sampling."""
    config = config_for("h2o")
    want = alone(tiny, "h2o", 5, 12)
    engine = Engine(tiny, slots=1, capacity=64)
    engine.plain = plain
    engine.join("x", Brain.start(tiny, prompt(tiny, 5, 50 + 5 % 17), config))
    made = [engine.step()["x"] for _ in range(5)]

    def garbage(module, args, logits):  # the sixth round's forward: one NaN among the logits
        handle.remove()
        logits = logits.clone()
        logits[0, -1, 7] = float("nan")
        return logits
    handle = tiny.model.lm_head.register_forward_hook(garbage)
    made += [engine.step()["x"] for _ in range(7)]
    assert engine.state.rebuilds == 1
    assert made[:7] == want[:7]


def in_and_out(engine: Engine, brain: Brain, filler) -> list[int]:
    """`brain`'s 100 tokens: 10 ticks alone, 40 rounds in `engine`, 20 alone, 20 rounds, 10
    alone; between, another sequence (`filler()`, a started Brain) ticks 3 rounds in the slot
    it left: nothing the brain took back may be a view of it."""
    made = [brain.step().token_id for _ in range(10)]
    for stay, alone_after in ((40, 20), (20, 10)):
        assert engine.refusal(brain, returning=True) is None
        engine.join("b", brain)
        made += [engine.step()["b"] for _ in range(stay)]
        engine.hand_back("b", brain)
        engine.join("filler", filler())
        for _ in range(3):
            engine.step()
        engine.leave("filler")
        made += [brain.step().token_id for _ in range(alone_after)]
    return made


@pytest.mark.parametrize("policy", PRESSES)
def test_a_sequence_handed_back_ticks_on_as_if_it_had_never_left_its_brain(tiny, policy):
    """A Brain ticks 10 times alone, 40 rounds in an engine beside another sequence, is handed
    back (another sequence then ticks in its slot), and ticks 20 alone, 20 in the engine, 10
    alone: its tokens, live rows,
    ledger, brightness, tick, sampler and policy state are those of a Brain that made every
    tick itself (seeded sampling for two of the presses)."""
    extra = dict(temperature=0.8, top_k=20) if policy in ("h2o", "random") else {}
    config = config_for(policy, **extra)
    want = Brain.start(tiny, prompt(tiny, 0, 70), config)
    expected = [want.step().token_id for _ in range(100)]
    brain = Brain.start(tiny, prompt(tiny, 0, 70), config)
    engine = Engine(tiny, slots=2, capacity=64, score_layers=config.recorded_layers)
    engine.join("other", Brain.start(tiny, prompt(tiny, 9, 40), config_for("streaming")))
    made = in_and_out(engine, brain, lambda: Brain.start(tiny, prompt(tiny, 20, 45), config_for("h2o")))
    assert engine.keys() == ["other"]
    assert made == expected
    mine, theirs = brain.state.mirror, want.state.mirror
    assert mine.live_token_ids() == theirs.live_token_ids() and mine.positions() == theirs.positions()
    assert [(e.token_id, e.state, e.tick_born, e.tick_died, e.brightness) for e in mine.ledger] == \
        [(e.token_id, e.state, e.tick_born, e.tick_died, e.brightness) for e in theirs.ledger]
    assert brain.tick == want.tick == 100
    assert torch.equal(brain.generator.get_state(), want.generator.get_state())
    if policy in ("h2o", "scored"):  # h2o's sums to the last bits of a share: the engine's attention is
        live = set(theirs.live.ledger_ids)  # written out, a Brain's is the model's kernel (docs/core.md)
        assert brain.policy.scorer.value == pytest.approx(
            {k: v for k, v in want.policy.scorer.value.items() if k in live}, rel=1e-6, abs=0)
        assert brain.policy.scorer.clock == want.policy.scorer.clock
    brain.state.check(deep=True)


def test_a_smartkv_sequence_with_pins_is_refused_by_name_and_nothing_changes(tiny, tmp_path):
    _, gates = bench_gates(tiny, tmp_path)
    config = config_for("smartkv", gates=gates)
    ids = prompt(tiny, 0, 60)
    brain = Brain.start(tiny, ids, config, pins=[tiny.decode(ids[10:13])])
    engine = Engine(tiny, slots=1, capacity=64, lanes=tiny.num_layers)
    assert engine.refusal(brain, returning=True) == "smartkv with pinned rows does not run on Core v4 yet"
    assert Engine(tiny, slots=1, capacity=64).refusal(Brain.start(tiny, ids, config), returning=True) is None


def test_input_given_to_rounds_is_read_as_a_brain_reads_it(tiny):
    """Forced tokens and a typed turn given to the engine's rounds (Engine.step(given)) beside
    another sequence that samples: the ledger (tokens, sources, ticks), the live rows and the
    tokens drawn after them are a lone Brain's that read the same input itself; the sampler
    does not move for a given token."""
    config = config_for("h2o", budget=64, temperature=0.8, top_k=20)
    forced = [41, 42, 43]

    def run_alone():
        brain = Brain.start(tiny, prompt(tiny, 0, 60), config)
        made = [brain.step().token_id for _ in range(5)]
        made += [brain.step(force).token_id for force in forced]
        brain.say("hi")
        while brain.pending_input:
            made.append(brain.step().token_id)
        return brain, made + [brain.step().token_id for _ in range(20)]

    want, expected = run_alone()
    brain = Brain.start(tiny, prompt(tiny, 0, 60), config)
    engine = Engine(tiny, slots=2, capacity=64)
    engine.join("other", Brain.start(tiny, prompt(tiny, 9, 40), config_for("streaming", temperature=0.9)))
    engine.join("b", brain)
    made = [engine.step()["b"] for _ in range(5)]
    made += [engine.step({"b": (force, "generated")})["b"] for force in forced]
    brain.say("hi")
    while brain.pending_input:
        made.append(engine.step({"b": (brain.pending_input[0], "user")})["b"])
        brain.input_added()
    made += [engine.step()["b"] for _ in range(20)]
    engine.hand_back("b", brain)
    assert made == expected
    mine, theirs = brain.state.mirror, want.state.mirror
    assert [(e.token_id, e.source, e.state, e.tick_born) for e in mine.ledger] == \
        [(e.token_id, e.source, e.state, e.tick_born) for e in theirs.ledger]
    assert "user" in {e.source for e in mine.ledger}
    assert torch.equal(brain.generator.get_state(), want.generator.get_state())
    with pytest.raises(ValueError, match="not in the engine"):
        engine.step({"nobody": (5, "user")})
    rounds = engine.state.tick(0)
    for bad in ((tiny.vocab_size, "user"), (-1, "user"), (5, "prompt"), (5.0, "user")):
        with pytest.raises(ValueError, match="a given token is"):
            engine.step({"other": bad})
    assert engine.state.tick(0) == rounds and engine.keys() == ["other"]  # nothing changed


@pytest.mark.parametrize("policy", PRESSES + ["smartkv", "smartkv+recall"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_round_of_many_sequences_dispatches_no_more_torch_ops_than_a_round_of_one(tiny, tmp_path, policy, temperature):
    """No loop over sequences in a round: 12 sequences past their budgets (each its own seed)
    dispatch at most the torch operations (kernel launches on a GPU) of the costliest round any
    of them makes alone (their edits differ: a round of all runs each branch one of them takes,
    hence the 1.25), plus what each draws from its own generator (sampling: a select and a
    multinomial; the random press: its rows' values from its generator's state, and the state
    kept, 6), and 24 no more than 12 but for those draws."""
    name, _, extra = policy.partition("+")
    settings = dict(recall=extra == "recall", temperature=temperature, top_k=20 if temperature else 0)
    if extra == "recall":
        settings["reread"] = False  # Core v4's rounds do not reread yet
    if name == "smartkv":
        settings["gates"] = bench_gates(tiny, tmp_path)[1]
    config = config_for(name, **settings)
    lanes = tiny.num_layers if name == "smartkv" else 1

    def ops_a_round(offsets: list[int]) -> list[int]:
        engine = Engine(tiny, slots=len(offsets), capacity=64, lanes=lanes, score_layers=config.recorded_layers)
        for offset in offsets:  # different seeds: a press's per-sequence setting parts no group
            engine.join(offset, Brain.start(tiny, prompt(tiny, offset, 60), dataclasses.replace(config, seed=offset)))
        counts = []
        for _ in range(12):
            with TorchOps() as ops:
                engine.step()
            counts.append(ops.count)
        return counts

    offsets = list(range(0, 48, 4))
    alone = max(count for offset in offsets for count in ops_a_round([offset]))
    together = max(ops_a_round(offsets))
    draw = (2 if temperature else 0) + (6 if name == "random" else 0)
    assert together <= 1.25 * alone + draw * len(offsets), (together, alone)
    # twice the sequences (the same edits and more): a loop of even one op a sequence would show
    twice = max(ops_a_round(offsets + [offset + 2 for offset in offsets]))
    assert twice <= together + draw * len(offsets) + 8, (twice, together)


PLAIN = ["streaming", "h2o", "scored", "brightness", "knorm"]  # the presses whose rounds below the budget are plain


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bit patterns (a float's as an int of its width), so NaN equals NaN."""
    if not tensor.is_floating_point():
        return tensor
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def test_plain_rounds_are_the_full_rounds_bit_for_bit(tiny):
    """A round in which no press deletes (below every budget) skips the selection and the
    compaction (`Engine._plain_round`): two engines, one taking plain rounds and one planning
    every round, hold the same tokens, the same tensors to the bit and the same mirrors, round
    after round, with greedy and sampling sequences of every plain press crossing their budgets,
    joining and leaving."""
    engines = [Engine(tiny, slots=5, capacity=64) for _ in range(2)]
    engines[1].plain = False
    rng = random.Random(5)
    added = 0

    def join(key, policy):  # greedy or sampling (each sequence drawing from its own generator, as alone)
        config = config_for(policy, budget=rng.choice([40, 48, 64]), repetition_penalty=rng.choice([1.0, 1.3]),
                            temperature=rng.choice([0, 0, 0.8]), top_k=20, seed=key)
        for engine in engines:
            engine.join(key, Brain.start(tiny, prompt(tiny, key % 40, 20 + key % 9), config))

    for key, policy in enumerate(PLAIN):
        join(key, policy)
    added = len(PLAIN)
    for round_ in range(70):
        if round_ in (20, 45):  # one leaves, another joins: slots change hands between plain rounds
            leaving = rng.choice(engines[0].keys())
            mirrors = [engine.leave(leaving) for engine in engines]
            assert mirrors[0].live_token_ids() == mirrors[1].live_token_ids()
            join(added, rng.choice(PLAIN))
            added += 1
        made = [engine.step() for engine in engines]
        assert made[0] == made[1], round_
        a, b = engines[0].state, engines[1].state
        active = a.active
        for name in ("length", "positions", "token_ids", "next_logits", "shares", "attention", "lane_shares"):
            assert torch.equal(getattr(a, name)[:active], getattr(b, name)[:active]), (round_, name)
        for name in a.row_state:  # bit patterns: knorm's rows not yet read are NaN in both
            assert torch.equal(bits(a.row_state[name][:active]), bits(b.row_state[name][:active])), (round_, name)
        assert engines[0].lengths == engines[1].lengths
    assert 0 < engines[0].plain_made < engines[0].rounds and engines[1].plain_made == 0
    for slot in range(engines[0].state.active):
        mirrors = [engine.state.mirror(slot) for engine in engines]
        assert mirrors[0].live_token_ids() == mirrors[1].live_token_ids()
        assert mirrors[0].positions() == mirrors[1].positions()
        assert [(e.state, e.token_id, e.position) for e in mirrors[0].ledger.entries] == \
            [(e.state, e.token_id, e.position) for e in mirrors[1].ledger.entries]
        mirrors[0].check(tiny.max_positions)


def test_a_plain_round_dispatches_a_fraction_of_a_full_rounds_operations(tiny):
    """What a plain round is for (each operation a kernel launch on a GPU): below the budget a
    round of brightness dispatches well under half the operations outside the forward of the
    round that plans, selects and compacts."""
    def ops_a_round(plain: bool) -> int:
        engine = Engine(tiny, slots=2, capacity=64)
        engine.plain = plain
        engine.join("a", Brain.start(tiny, prompt(tiny, 0, 20), config_for("brightness")))
        engine.step()
        forward, inside = engine.state._forward, []

        def counted(*args):
            with TorchOps() as ops:
                result = forward(*args)
            inside.append(ops.count)
            return result
        engine.state._forward = counted
        with TorchOps() as ops:
            engine.step()
        assert engine.plain_made == (2 if plain else 0) and len(inside) == 1
        return ops.count - inside[0]

    full, plain = ops_a_round(False), ops_a_round(True)
    assert plain < 0.5 * full, (plain, full)
