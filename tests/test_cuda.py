"""The brain on a CUDA GPU: the invariants the CPU suite proves, checked where the tensors live
on the device (index tensors, masks, the ring's free run, packed rows, per-layer rows).
Skipped without a GPU — CI has none; bench/results/gpu.md records the runs on a lent GPU.

Every run ends in `check(deep=True)`: the mirror's invariants, the cache's shape, and layer 0
of the cache against a fresh computation of the live tokens at their recorded positions.
"""

import pytest
import torch
from transformers import DynamicCache

from positronic import SpliceCache, load_model
from positronic.brain import session as sessions
from positronic.brain.loop import Brain, BrainConfig
from positronic.smartkv import GateSet, SmartKVCache
from positronic.models import with_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpu_tiny():
    return load_model("random:tiny", device="cuda", dtype="float32")


def prompt(lm, count: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [lm.bos_id] + torch.randint(3, lm.vocab_size, (count - 1,), generator=g).tolist()


RUNS = [
    dict(policy="brightness"),
    dict(policy="brightness", repairer="self", repair_batch=1),
    dict(policy="brightness", repairer="bridge"),
    dict(policy="streaming", kv_store="ring"),
    dict(policy="h2o"),
    dict(policy="brightness", kv_format="int4"),
    dict(policy="streaming", kv_format="fp4"),
    dict(policy="brightness", kv_format="int4h"),
    dict(policy="none", kv_format="int4h", at_capacity="shift"),
    dict(policy="brightness", recall=True),
]


@pytest.mark.parametrize("settings", RUNS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_ticks_on_the_gpu_keep_cache_and_mirror_in_step(gpu_tiny, settings):
    brain = Brain.start(gpu_tiny, prompt(gpu_tiny, 30), BrainConfig(budget=48, seed=3, **settings))
    for tick in range(120):
        record = brain.step()
        assert not record.rebuilt, record.error
        assert record.live_length <= 48
        if tick % 40 == 39:
            brain.state.check(deep=True)
    assert brain.state.cache.layers[0].keys.is_cuda
    assert brain.counts["culls"] + brain.counts.get("repairs", 0) > 0


def test_a_rebuild_on_the_gpu_equals_a_fresh_prefill_at_the_recorded_positions(gpu_tiny):
    brain = Brain.start(gpu_tiny, prompt(gpu_tiny, 30, seed=1), BrainConfig(budget=40, seed=4))
    for _ in range(50):
        brain.step()
    state = brain.state
    state.rebuild()
    state.check(deep=True)
    with torch.no_grad():
        fresh = gpu_tiny.model(torch.tensor([state.live_token_ids()], device="cuda"),
                               position_ids=torch.tensor([state.positions()], device="cuda")).logits[0, -1]
    torch.testing.assert_close(state.next_logits, fresh, atol=1e-4, rtol=1e-4)


def test_a_session_saved_on_the_gpu_resumes_and_goes_on_exactly(gpu_tiny, tmp_path):
    config = BrainConfig(budget=40, seed=5, temperature=0)
    brain = Brain.start(gpu_tiny, prompt(gpu_tiny, 30, seed=2), config)
    for _ in range(45):
        brain.step()
    sessions.save(tmp_path, brain, gpu_tiny.name)
    resumed = sessions.resume(gpu_tiny, tmp_path)
    ahead = [brain.step().token_id for _ in range(20)]
    assert [resumed.step().token_id for _ in range(20)] == ahead


@pytest.mark.parametrize("store", ["splice", "ring"])
def test_generate_with_a_splice_cache_on_the_gpu_equals_the_dynamic_cache(gpu_tiny, store):
    ids = torch.tensor([prompt(gpu_tiny, 24, seed=6)], device="cuda")
    reference = gpu_tiny.model.generate(ids, **with_cache(DynamicCache(config=gpu_tiny.model.config)),
                                        max_new_tokens=16, do_sample=False)
    cache = SpliceCache(gpu_tiny.model.config, max_cache_len=64, store=store, sinks=4)
    assert torch.equal(gpu_tiny.model.generate(ids, **with_cache(cache), max_new_tokens=16, do_sample=False),
                       reference)


def test_smartkv_on_the_gpu_in_generate_and_in_the_brain(gpu_tiny, tmp_path):
    gates = GateSet.for_config(gpu_tiny.model.config, seed=7)
    path = tmp_path / "gates.safetensors"
    gates.save(path)
    ids = torch.tensor([prompt(gpu_tiny, 60, seed=8)], device="cuda")
    cache = SmartKVCache(gpu_tiny.model.config, gates=GateSet.load(path), sinks=4, budget=24)
    out = gpu_tiny.model.generate(ids, **with_cache(cache), max_new_tokens=12, do_sample=False)
    assert out.shape == (1, 72) and cache.seen == 71 and cache.rows < 71  # rows were pruned
    brain = Brain.start(gpu_tiny, prompt(gpu_tiny, 40, seed=9),
                        BrainConfig(policy="smartkv", budget=24, sinks=3, window=6, gates=str(path), seed=1))
    for _ in range(40):
        assert not brain.step().rebuilt
    brain.state.check(deep=True)


@pytest.mark.parametrize("policy", ["brightness", "smartkv"])
def test_a_batch_on_the_gpu_gives_each_sequence_what_it_gets_alone(gpu_tiny, tmp_path, policy, alone, batched):
    """One shared forward per tick on the device (packed rows, each sequence's pick of query and
    normaliser, per-layer rows for smartkv, recall's lanes): greedy and seeded sampling, over
    budget, each sequence's tokens equal its run alone (float32), and every state checks."""
    path = tmp_path / "gates.safetensors"
    GateSet.for_config(gpu_tiny.model.config, seed=7).save(path)
    configs = [dict(policy=policy, recall=True, budget=28, sinks=3, window=6, seed=1, temperature=0),
               dict(policy=policy, recall=True, budget=32, sinks=3, window=6, seed=2, temperature=0.9),
               dict(policy=policy, budget=24, sinks=3, window=6, seed=3, temperature=0.7, top_k=20)]
    if policy == "smartkv":
        for config in configs:
            config["gates"] = str(path)
            if config.get("recall"):
                config["reread"] = False  # one forward a tick: a reread's second forward is counted apart
    prompts = [prompt(gpu_tiny, 40 + 6 * k, seed=20 + k) for k in range(len(configs))]
    ticks = 30
    want = [alone(gpu_tiny, text, ticks, **config) for text, config in zip(prompts, configs)]
    batch, got = batched(gpu_tiny, prompts, configs, ticks)
    assert got == want
    assert batch.meeting.forwards == ticks
    for brain in batch.brains.values():
        assert brain.state.cache.layers[0].keys.is_cuda
        if brain.config.memory_rank == "recent":  # smartkv with recall: the shares computed on the device
            assert brain.policy.memory.used.any()
        brain.state.check(deep=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_32_sequences_in_half_precision_choose_the_tokens_they_choose_alone(alone, batched, dtype):
    """In float16, B = 32 batched chose other tokens than alone on every lease up to 2026-11-30
    (bench/results/gpu.md; float32 kept them): a product's or a norm's kernel changed with the
    row count. The loader tiles those layers (positronic/models/tiles.py), so 32 greedy
    sequences over budget, on a random model (flat logits: near-ties everywhere), must make
    alone's tokens."""
    lm = load_model("random:tinyllama", device="cuda", dtype=dtype)
    assert any(type(m).__name__ == "TiledLinear" for m in lm.model.modules())
    configs = [dict(policy="streaming", budget=48, sinks=3, seed=k, temperature=0) for k in range(32)]
    prompts = [prompt(lm, 56 + k, seed=40 + k) for k in range(32)]
    ticks = 8
    want = [alone(lm, text, ticks, **config) for text, config in zip(prompts, configs)]
    batch, got = batched(lm, prompts, configs, ticks)
    differing = [k for k in range(32) if got[k] != want[k]]
    assert not differing, f"sequences {differing} differ from alone"


def test_tick_host_counts_the_gpu_waits_of_a_tick(capsys, bench_script):
    """bench/tick_host.py on the GPU: each row's forward and host time, and a number of waits
    (torch's sync debug mode) where the CPU prints '-', split by the line that waited."""
    script = bench_script("tick_host")
    assert script.main(["--model", "random:tiny", "--device", "cuda", "--budget", "48", "--ticks", "4",
                        "--rounds", "1", "--warm", "8", "--policies", "streaming"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("streaming ")]
    assert [row[1] for row in rows] == ["under", "past"]
    for row in rows:
        assert 0 < float(row[3]) < float(row[2]) and float(row[7]) >= 0
    # each run's waits by the line that waited, which add up to the table's number
    for row in rows:
        head = lines.index(f"streaming, {row[1]} the budget: GPU waits per tick by the line that waited")
        sites = []
        for line in lines[head + 1:]:
            if not line.strip() or line.startswith("streaming"):
                break
            sites.append(line.split())
        assert all(":" in site for _, site in sites)
        assert abs(sum(float(count) for count, _ in sites) - float(row[7])) < 0.1


def engine_prompt(lm, seed: int) -> list[int]:
    return prompt(lm, 50, seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_rounds_on_the_gpu_make_each_sequences_alone_tokens_and_capture_nothing_new(dtype):
    """Core v4's compiled round on the device (inductor's Triton kernels in captured CUDA graphs
    over the slot buffers): four sequences of four presses past their budget make, token for
    token, what each makes in a compiled engine of its own; then 120 rounds with joins and
    leaves make no graph past each bucket's first."""
    import random

    from positronic.batch.engine import Engine

    lm = load_model("random:tiny", device="cuda", dtype=dtype)
    configs = [BrainConfig(policy=policy, budget=40, temperature=0, seed=3)
               for policy in ("h2o", "streaming", "brightness", "scored")]
    engine = Engine(lm, slots=4, capacity=64, compiled=True)
    for k, config in enumerate(configs):
        engine.join(k, Brain.start(lm, engine_prompt(lm, 60 + k), config))
    made = {k: [] for k in range(4)}
    for _ in range(24):
        for k, token in engine.step().items():
            made[k].append(token)
    for k, config in enumerate(configs):
        single = Engine(lm, slots=1, capacity=64, compiled=True)
        single.join(k, Brain.start(lm, engine_prompt(lm, 60 + k), config))
        assert [single.step()[k] for _ in range(24)] == made[k], f"sequence {k} ({dtype})"
    assert engine.state.kv.keys.is_cuda
    for active in (4, 2, 1):  # every bucket of this engine has its graph
        while len(engine) > active:
            engine.leave(engine.keys()[-1])
        engine.step()
    graphs, rng, joined = engine.state.compiled.compiles, random.Random(0), 4
    for _ in range(120):
        if len(engine) < 4 and (not len(engine) or rng.random() < 0.3):
            engine.join(joined, Brain.start(lm, engine_prompt(lm, joined), configs[joined % 4]))
            joined += 1
        elif len(engine) > 1 and rng.random() < 0.25:
            engine.leave(rng.choice(engine.keys()))
        engine.step()
    assert engine.state.compiled.compiles == graphs and joined > 15
    assert engine.state.compiled.graph.broken is None


def test_compiled_plain_rounds_on_the_gpu_make_the_full_rounds_tokens(gpu_tiny):
    """Plain rounds on the device (the prelude and the writes compiled to Triton, the forward in
    its captured graph): the tokens of an engine that plans every round, sequences crossing
    their budgets, and no graph made after the first rounds of each bucket."""
    from positronic.batch.engine import Engine
    from positronic.batch.plain import PRELUDES
    from positronic.state.plain import SETTLES

    config = BrainConfig(policy="h2o", budget=48, temperature=0, repetition_penalty=1.2, seed=3)
    engines = [Engine(gpu_tiny, slots=2, capacity=64, compiled=True) for _ in range(2)]  # one bucket: one compile
    engines[1].plain = False
    engines[0].warm(config)
    graphs = (engines[0].state.compiled.compiles, PRELUDES.compiles, SETTLES.compiles)
    for engine in engines:
        for k in range(2):
            engine.join(k, Brain.start(gpu_tiny, engine_prompt(gpu_tiny, 80 + k)[:20 + 3 * k], config))
    for round_ in range(50):
        assert engines[0].step() == engines[1].step(), round_
    assert 0 < engines[0].plain_made < engines[0].rounds
    assert (engines[0].state.compiled.compiles, PRELUDES.compiles, SETTLES.compiles) == graphs
    assert PRELUDES.broken is None and SETTLES.broken is None


def test_the_eager_round_on_the_gpu_is_the_brains_tick(gpu_tiny):
    """Core v4's eager round (one batched attention call a layer over the slot buffers) on the
    device: a sequence past its budget makes the tokens its Brain makes alone, float32."""
    from positronic.batch.engine import Engine

    config = BrainConfig(policy="h2o", budget=40, temperature=0, seed=3)
    brain = Brain.start(gpu_tiny, engine_prompt(gpu_tiny, 70), config)
    want = [brain.step().token_id for _ in range(30)]
    engine = Engine(gpu_tiny, slots=2, capacity=64)
    engine.join("x", Brain.start(gpu_tiny, engine_prompt(gpu_tiny, 70), config))
    assert [engine.step()["x"] for _ in range(30)] == want
