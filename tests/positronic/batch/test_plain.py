"""A plain round's prelude (positronic/batch/plain.py): compiled, the eager prelude's bits; in a
compiled engine, the full rounds' tokens, with one graph a bucket however sequences come and go, all made before serving by `Engine.warm(config)`."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from positronic.batch.engine import Engine
from positronic.batch.plain import PRELUDES, prelude
from positronic.brain.loop import Brain, BrainConfig
from positronic.state.plain import SETTLES

TEXT = list(range(3, 240, 3)) + list(range(7, 200, 5))


def config_for(policy: str, **extra) -> BrainConfig:
    return BrainConfig(**{**dict(policy=policy, budget=48, temperature=0, seed=3), **extra})


def start(lm, offset: int, config: BrainConfig) -> Brain:
    return Brain.start(lm, [lm.bos_id] + TEXT[offset : offset + 20 + offset % 7], config)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({4: torch.int32, 8: torch.int64}[tensor.element_size()]) if tensor.is_floating_point() else tensor


@pytest.mark.parametrize("policy,penalty", [("brightness", 1.3), ("h2o", 1.0), ("scored", 1.3), ("streaming", 1.0)])
def test_the_compiled_prelude_is_the_eager_preludes_bits(tiny, policy, penalty):
    """Three sequences some rounds in (their shares and row state real): the compiled prelude's
    tokens and next row state equal the eager one's, bit for bit, over the whole bucket."""
    config = config_for(policy, repetition_penalty=penalty)
    engine = Engine(tiny, slots=4, capacity=64, compiled=True)
    for k in range(3):
        engine.join(k, start(tiny, 7 * k, config))
    for _ in range(5):
        engine.step()
    state, press = engine.state, engine.sequences[0].press
    at = slice(0, state.compiled.bucket(3))
    tensors = (state.next_logits[at], state.length[at], state.positions[at, 0], state.token_ids[at, 0],
               state.shares[at], state.row_state["pinned"][at],
               {name: state.row_state[f"{press.name}.{name}"][at] for name in press.row_state},
               torch.tensor([5, 5, 5, 0]))
    made = PRELUDES((press.group, config.penalty_window, penalty),
                    functools.partial(prelude, press, config.penalty_window, penalty), *tensors)
    want = prelude(press, config.penalty_window, penalty, *tensors)
    assert PRELUDES.broken is None
    assert torch.equal(made[0], want[0])
    assert made[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(bits(made[1][name]), bits(want[1][name])), name


def test_compiled_plain_rounds_make_the_full_rounds_tokens_and_one_prelude_a_bucket(tiny):
    """Two compiled engines, one taking plain rounds (its tokens and scores from the compiled
    prelude) and one planning every round: the same tokens round after round, with sequences
    joining and leaving over buckets 2, 4 and 5 and crossing their budgets; after each bucket's
    first plain round no prelude is compiled again."""
    config = config_for("h2o", repetition_penalty=1.2)
    engines = [Engine(tiny, slots=5, capacity=64, compiled=True) for _ in range(2)]
    engines[1].plain = False
    rng, joined, seen, compiles = random.Random(3), 0, set(), None
    for round_ in range(80):
        active = len(engines[0])
        if active < 5 and (not active or rng.random() < 0.3):
            for engine in engines:
                engine.join(joined, start(tiny, joined % 40, config))
            joined += 1
        elif active > 1 and rng.random() < 0.2:
            key = rng.choice(engines[0].keys())
            for engine in engines:
                engine.leave(key)
        before = engines[0].plain_made
        made = [engine.step() for engine in engines]
        assert made[0] == made[1], round_
        bucket = engines[0].state.compiled.bucket(len(engines[0]))
        if engines[0].plain_made > before:
            if bucket in seen:
                assert graphs(engines[0]) == compiles, (round_, bucket)
            seen.add(bucket)
            compiles = graphs(engines[0])
    assert seen == {2, 4, 5} and 0 < engines[0].plain_made < engines[0].rounds
    assert PRELUDES.broken is None and SETTLES.broken is None


def graphs(engine: Engine) -> tuple[int, int, int]:
    return engine.state.compiled.compiles, PRELUDES.compiles, SETTLES.compiles


def test_warming_with_the_settings_makes_every_buckets_graphs(tiny):
    """`Engine.warm(config)` (a server before it serves) makes, for every bucket, the forward's
    graph and a plain round's writes for the settings' press, and for greedy settings its prelude
    (of the press and penalty): the plain rounds after it compile nothing, greedy or sampling."""
    config = config_for("streaming", repetition_penalty=1.17)  # a penalty no other test compiles
    engine = Engine(tiny, slots=3, capacity=64, compiled=True)
    before = PRELUDES.compiles
    engine.warm(config)
    assert PRELUDES.compiles == before + len(engine.state.compiled.sizes)
    warmed = graphs(engine)
    for k in range(3):
        engine.join(k, start(tiny, 5 * k, config))
        engine.step()
    while len(engine) > 1:
        engine.leave(engine.keys()[-1])
        engine.step()
    assert engine.plain_made == engine.rounds == 5 and graphs(engine) == warmed
    sampling = config_for("scored", temperature=0.8, top_k=20)  # no prelude: the writes alone
    engine = Engine(tiny, slots=3, capacity=64, compiled=True)
    engine.warm(sampling)
    warmed = graphs(engine)
    for k in range(3):
        engine.join(k, start(tiny, 5 * k, sampling))
        engine.step()
    assert engine.plain_made == engine.rounds == 3 and graphs(engine) == warmed
