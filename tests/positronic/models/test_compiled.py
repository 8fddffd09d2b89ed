"""The compiled decode round (positronic/models/compiled.py): one graph per bucket for a run of
any length, batched = alone bit for bit, the eager round's numbers to float tolerance, a failed
round rebuilt without poisoning the graph, and what it cannot run refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from positronic.batch.engine import Engine
from positronic.brain.loop import Brain, BrainConfig
from positronic.models import load_model
from positronic.models.compiled import buckets
from positronic.smartkv.gates import bench_gates
from positronic.util import TorchOps

PRESSES = ["streaming", "h2o", "scored", "brightness", "random", "knorm"]
TEXT = list(range(3, 240, 3)) + list(range(7, 200, 5))


def config_for(policy: str, **extra) -> BrainConfig:
    return BrainConfig(**{**dict(policy=policy, budget=40, temperature=0, seed=3), **extra})


def prompt(lm, offset: int, length: int) -> list[int]:
    return [lm.bos_id] + TEXT[offset : offset + length]


def alone(lm, config: BrainConfig, offset: int, rounds: int, **engine) -> list[int]:
    """A sequence's tokens in a compiled engine of its own (padded to 2 slots)."""
    single = Engine(lm, slots=1, capacity=64, compiled=True, **engine)
    single.join("x", Brain.start(lm, prompt(lm, offset, 50), config))
    return [single.step()["x"] for _ in range(rounds)]


def pair(lm, configs: list[BrainConfig], spacing: int, **engine) -> list[Engine]:
    """An eager and a compiled engine holding the same sequences (configs[k]'s at prompt offset
    spacing * k)."""
    engines = [Engine(lm, slots=len(configs), compiled=compiled, **engine) for compiled in (False, True)]
    for engine in engines:
        for k, config in enumerate(configs):
            engine.join(k, Brain.start(lm, prompt(lm, spacing * k, 50), config))
    return engines


def test_buckets_pad_to_powers_of_two_and_the_slots():
    assert buckets(1) == [2] and buckets(2) == [2] and buckets(5) == [2, 4, 5] and buckets(32) == [2, 4, 8, 16, 32]
    assert buckets(1, 1) == [1] and buckets(2, 1) == [1, 2] and buckets(5, 1) == [1, 2, 4, 5]


@pytest.fixture(scope="module")
def tiny_w8():
    """random:tiny with --weights int8-weight-only: its rounds' products are the eager layers' kernel."""
    return load_model("random:tiny", device="cpu", dtype="float32", weights="int8-weight-only")


def test_batched_sequences_make_their_alone_tokens_as_they_join_and_leave(tiny):
    """Six sequences of mixed presses and samplers join and leave at random rounds in a compiled
    engine (buckets 2, 4 and 6 in turn): each makes, token for token, what it makes alone."""
    rng = random.Random(6)
    plans = []
    for k, policy in enumerate(PRESSES):
        extra = dict(budget=rng.choice([40, 44, 48]), seed=k)
        if k % 3 == 1:
            extra.update(temperature=0.8, top_k=20)
        joins = rng.randrange(0, 10)
        plans.append((k, config_for(policy, **extra), 5 * k, joins, joins + rng.randrange(10, 25)))
    engine = Engine(tiny, slots=len(plans), capacity=64, compiled=True)
    made = {k: [] for k, *_ in plans}
    for number in range(40):
        for k, config, offset, joins, leaves in plans:
            if number == joins:
                engine.join(k, Brain.start(tiny, prompt(tiny, offset, 50), config))
            if number == leaves:
                engine.leave(k)
        for k, token in engine.step().items():
            made[k].append(token)
    for k, config, offset, *_ in plans:
        assert len(made[k]) >= 10 and made[k] == alone(tiny, config, offset, len(made[k])), f"sequence {k}"


def test_a_long_run_with_evictions_joins_and_leaves_compiles_nothing_new(tiny):
    """200 rounds, every sequence past its budget (an eviction a round), sequences joining and
    leaving so that 1 to 8 are active: once each bucket has its graph, none is made again."""
    engine = Engine(tiny, slots=8, capacity=48, compiled=True)
    graphs = engine.state.compiled.compiles  # a model's graphs are shared: the tests before made some
    config = config_for("h2o", budget=40)
    for k in range(8):  # warm every bucket: 8, then 4, then 2 active
        engine.join(k, Brain.start(tiny, prompt(tiny, 3 * k, 45), config))
    for active in (8, 4, 2, 1):
        while len(engine) > active:
            engine.leave(engine.keys()[-1])
        engine.step()
    compiled = engine.state.compiled.compiles
    rng, joined, evicting = random.Random(0), 8, 0
    for _ in range(200):
        if len(engine) < 8 and (not len(engine) or rng.random() < 0.3):
            engine.join(joined, Brain.start(tiny, prompt(tiny, joined % 40, 45), config))
            joined += 1
        elif len(engine) > 1 and rng.random() < 0.25:
            engine.leave(rng.choice(engine.keys()))
        made = engine.step()
        assert len(made) == len(engine.removed)
        evicting += sum(bool(rows) for rows in engine.removed.values())
    assert engine.state.compiled.compiles == compiled <= graphs + len(buckets(8))
    assert evicting > 400 and joined > 30


def test_the_compiled_round_is_the_eager_round_to_float_tolerance(tiny):
    """The same sequences in an eager and a compiled engine: every round's logits and shares
    agree to 1e-5 (inductor reorders sums; the eager round is the Brain's, bit for bit), and so
    do the tokens on this model."""
    engines = pair(tiny, [config_for(policy) for policy in ("h2o", "streaming", "brightness")], 9, capacity=64)
    for _ in range(30):
        eager, compiled = (engine.step() for engine in engines)
        assert eager == compiled
        states = [engine.state for engine in engines]
        torch.testing.assert_close(states[1].next_logits[:3], states[0].next_logits[:3], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[1].attention[:3], states[0].attention[:3], atol=1e-5, rtol=1e-5)


def test_smartkv_with_recall_compiled_makes_its_alone_tokens_and_eagers_numbers(tiny, tmp_path):
    """SmartKV's lanes (one per layer) read every layer's shares, queries and log-normalisers
    from the graph: three sequences batched make their alone tokens, and the newest queries and
    norms are the eager engine's to float tolerance."""
    _, gates = bench_gates(tiny, tmp_path)
    configs = [config_for("smartkv", gates=gates, recall=True, reread=False, budget=48, seed=k) for k in range(3)]
    shape = dict(capacity=64, lanes=tiny.num_layers, score_layers="all")
    engines = pair(tiny, configs, 11, **shape)
    made = {k: [] for k in range(3)}
    for _ in range(30):
        eager, compiled = (engine.step() for engine in engines)
        assert eager == compiled
        for k, token in compiled.items():
            made[k].append(token)
        states = [engine.state for engine in engines]
        for name in ("queries", "log_norms", "lane_shares"):
            torch.testing.assert_close(getattr(states[1], name)[:3], getattr(states[0], name)[:3], atol=1e-5, rtol=1e-5)
    for k, config in enumerate(configs):
        single = Engine(tiny, slots=1, compiled=True, **shape)
        single.join("x", Brain.start(tiny, prompt(tiny, 11 * k, 50), config))
        assert [single.step()["x"] for _ in range(30)] == made[k]


def test_a_failed_round_is_rebuilt_and_the_rounds_after_it_stay_compiled(tiny):
    """A cache row gone bad (NaN keys) makes the next forward's logits not finite, which
    rebuilds the sequence from its mirror (a fresh prefill of its live rows, whose K/V are not
    the ones the rounds wrote: the tokens after it are the eager engine's after the same
    rebuild, not an undisturbed run's), and a round under an op counter runs the same function
    eagerly. Neither makes a graph again or stops the compiled rounds."""
    config, made = config_for("h2o"), []
    for compiled in (False, True):
        engine = Engine(tiny, slots=2, capacity=64, compiled=compiled)
        engine.join("x", Brain.start(tiny, prompt(tiny, 5, 50), config))
        tokens = [engine.step()["x"] for _ in range(4)]
        graphs = engine.state.compiled.compiles if compiled else 0
        engine.state.kv.keys[:, 0, :, 3] = float("nan")
        tokens += [engine.step()["x"] for _ in range(3)]
        with TorchOps() as ops:
            tokens.append(engine.step()["x"])
        tokens += [engine.step()["x"] for _ in range(4)]
        assert engine.state.rebuilds == 1 and ops.count > 100
        made.append(tokens)
    assert engine.state.compiled.compiles == graphs and engine.state.compiled.graph.broken is None
    assert made[1] == made[0] and made[1][:4] == alone(tiny, config, 5, 4)


def test_what_a_compiled_round_cannot_run_is_refused_by_name():
    int8 = load_model("random:llama3", device="cpu", dtype="float32", weights="int8")
    with pytest.raises(ValueError, match="float weights or --weights int8-weight-only, not --weights int8 .*--dtype bfloat16"):
        Engine(int8, slots=2, capacity=32, compiled=True)
    qwen = load_model("random:qwen2", device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="Llama-class models; Qwen2ForCausalLM"):
        Engine(qwen, slots=2, capacity=32, compiled=True)


def test_warming_an_empty_engine_makes_every_buckets_graph_before_any_round(tiny):
    """`Engine.warm` (a server with --compile, before it serves): every bucket's graph made at
    once; the rounds after it, whatever their size, make none; with a sequence in, refused."""
    engine = Engine(tiny, slots=5, capacity=56, compiled=True)  # capacity 56: shapes no other test's
    made = engine.warm()
    graphs = engine.state.compiled.compiles
    assert made == len(buckets(5)) == 3
    for k in range(5):
        engine.join(k, Brain.start(tiny, prompt(tiny, 4 * k, 50), config_for("h2o")))
        engine.step()
    assert engine.state.compiled.compiles == graphs
    with pytest.raises(ValueError, match="warmed before sequences join; 5 have"):
        engine.warm()
    assert Engine(tiny, slots=2, capacity=56).warm() == 0  # eager: nothing to make


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_in_half_precision_batched_sequences_make_their_alone_tokens(dtype):
    """bfloat16 and float16 on a CPU: four sequences of four presses in one compiled engine make,
    token for token, what each makes in a compiled engine of its own (against the eager round
    they part at near-ties: 137 of 150 tokens equal in bfloat16 when this was written). In
    bfloat16 the products are inductor's own GEMM templates, picked by timing (`inductor_settings`):
    a row's bits the same in buckets 2 and 4 as alone."""
    lm = load_model("random:tiny", device="cpu", dtype=dtype)
    configs = [config_for(policy) for policy in ("h2o", "streaming", "brightness", "scored")]
    engine = Engine(lm, slots=4, capacity=64, compiled=True)
    for k, config in enumerate(configs):
        engine.join(k, Brain.start(lm, prompt(lm, 9 * k, 50), config))
    made = {k: [] for k in range(4)}
    for _ in range(30):
        for k, token in engine.step().items():
            made[k].append(token)
    for k, config in enumerate(configs):
        assert made[k] == alone(lm, config, 9 * k, 30), f"sequence {k} ({dtype})"


def test_more_graphs_than_dynamos_default_limit_are_made_in_any_thread(tiny):
    """Dynamo keeps at most 8 graphs of one function unless told otherwise, and its settings are
    per thread: a round raises the limit for its own call, so a ninth engine shape in this thread
    compiles too, after another thread made one (a fresh clone's suite hit the limit once)."""
    import threading

    thread = threading.Thread(target=lambda: Engine(tiny, slots=2, capacity=80, compiled=True).warm())
    thread.start()
    thread.join()
    engines = [Engine(tiny, slots=2, capacity=capacity, compiled=True) for capacity in range(81, 90)]
    assert [engine.warm() for engine in engines] == [1] * 9
    assert all(engine.state.compiled.graph.broken is None for engine in engines)


@pytest.mark.parametrize("weights", ["float32", "int8-weight-only"])
def test_a_slots_numbers_are_the_same_bits_in_every_bucket(weights, tiny, tiny_w8):
    """The same rows, tokens and positions in buckets of 2, 4 and 8 (and 1, where the products
    sum a lone row as they sum it among others: int8-weight-only): slot 0's and 1's logits,
    shares, queries and log-normalisers are the same bits (what makes batched = alone hold;
    without inductor's freezing the float32 products' bits moved with the row count)."""
    from positronic.models.compiled import CompiledRound

    tiny = tiny_w8 if weights == "int8-weight-only" else tiny
    generator = torch.Generator().manual_seed(0)
    shape = (tiny.num_layers, 8, tiny.num_kv_heads, 64, tiny.head_dim)
    keys, values = (torch.randn(shape, generator=generator) * 0.3 for _ in range(2))
    tokens = torch.randint(3, 500, (8,), generator=generator)
    rows = torch.randint(10, 60, (8,), generator=generator)
    results = {}
    for size in (1, 2, 4, 8):
        round_ = CompiledRound(tiny, keys.clone(), values.clone(), [0, 1])
        assert round_.bucket(size) == (2 if size == 1 and weights == "float32" else size)
        results[size] = round_(tokens[:size], rows[:size], rows[:size] + 5)
    for size in (2, 4, 8):
        for got, want in zip(results[size], results[2]):
            assert torch.equal(got[:2], want), size
        for got, want in zip(results[size], results[1]):
            assert torch.equal(got[:1], want), size


def test_int8_weight_only_rounds_make_their_alone_tokens_and_the_eager_rounds_numbers(tiny_w8):
    """--weights int8-weight-only compiled: four sequences of four presses in one engine (bucket
    4) make, token for token, what each makes in an engine of its own (a round of one slot);
    and the compiled rounds' logits and shares are the eager rounds' to float tolerance (the
    products are the same kernel's sums; the rest inductor fuses and reorders)."""
    configs = [config_for(policy) for policy in ("h2o", "streaming", "brightness", "scored")]
    engines = pair(tiny_w8, configs, 9, capacity=64)
    made = {k: [] for k in range(4)}
    for _ in range(30):
        eager, compiled = (engine.step() for engine in engines)
        for k, token in compiled.items():
            made[k].append(token)
        states = [engine.state for engine in engines]
        torch.testing.assert_close(states[1].next_logits[:4], states[0].next_logits[:4], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[1].attention[:4], states[0].attention[:4], atol=1e-5, rtol=1e-5)
    assert engines[1].state.compiled.bucket(1) == 1
    for k, config in enumerate(configs):
        assert made[k] == alone(tiny_w8, config, 9 * k, 30), f"sequence {k}"
