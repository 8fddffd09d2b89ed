"""Batched ticks: each sequence of a batch gets exactly what it gets alone."""

import random

import pytest
import torch

from positronic import mirror as mirror_pkg
from positronic.batch import Batch, forward_many
from positronic.brain import session
from positronic.brain.loop import Brain, BrainConfig
from positronic.kv.cache import SpliceCache
from positronic.state.forward import forward, prefill, prepare

PROMPTS = [[1] + list(range(40, 70)), [1] + list(range(200, 236)), [1] + list(range(90, 115)), [1, 5, 6, 7] * 8]


def started(lm, prompt, **config) -> Brain:
    return Brain.start(lm, prompt, BrainConfig(**config))


@pytest.mark.parametrize("weights", [True, False])
def test_one_forward_over_several_caches_gives_each_what_it_gets_alone(tiny, weights):
    """Three sequences of different lengths, one feeding three rows under a mask, the others
    one: logits, predictions, attention row (or, without weights, none: a per-layer policy's
    forward), query and log-normaliser as alone, and the same rows written: bit for bit (the
    linear layers give a row the same numbers whatever rows are beside it, models/linear.py)."""
    prompts = [list(range(3, 20)), list(range(50, 58)), list(range(100, 130))]
    feeds = [[21], [60, 61, 62], [131]]
    shared, solo = [], []
    for prompt in prompts:
        for caches in (shared, solo):
            cache = SpliceCache(tiny.model.config, max_cache_len=64)
            prefill(tiny, cache, prompt, list(range(len(prompt))))
            caches.append(cache)
    parts, expected = [], []
    for prompt, feed, cache, twin in zip(prompts, feeds, shared, solo):
        positions = list(range(len(prompt), len(prompt) + len(feed)))
        keys = list(range(len(prompt))) + positions
        parts.append(prepare(tiny, cache, feed, positions, keys, attention_layers=[0, 1], weights=weights))
        expected.append(forward(tiny, twin, feed, positions, keys, attention_layers=[0, 1], weights=weights))
    got = forward_many(tiny, parts)
    for a, b, cache, twin in zip(got, expected, shared, solo):
        assert torch.equal(a.predicted, b.predicted)
        assert torch.equal(a.logits, b.logits)
        if weights:
            assert torch.equal(a.attention, b.attention)
        else:
            assert a.attention is None and b.attention is None
        assert torch.equal(a.query, b.query) and torch.equal(a.log_norm, b.log_norm)
        for layer, other in zip(cache.layers, twin.layers):
            assert layer.length == other.length
            assert torch.equal(layer.keys, other.keys) and torch.equal(layer.values, other.values)


@pytest.mark.parametrize("engine", [True, False], ids=["engine", "brains"])
@pytest.mark.parametrize("policy", ["brightness", "streaming", "scored", "h2o", "none", "random"])
def test_a_batch_ticks_every_policy_exactly_as_alone(tiny, policy, alone, batched, engine):
    """Greedy and seeded sampling, different prompts and budgets, through the budget (edits
    every tick): each sequence's tokens are the ones it makes alone, and its state checks.
    In engine rounds (one engine, room for the widest budget) or each brain's own tick with
    one shared forward (`engine=False`)."""
    configs = [dict(policy=policy, budget=44, seed=1, temperature=0),
               dict(policy=policy, budget=48, seed=2, temperature=1.0),
               dict(policy=policy, budget=40, seed=3, temperature=0.8, top_k=20)]
    if policy == "none":
        for config in configs:
            config["at_capacity"] = "shift"
    ticks = 30
    want = [alone(tiny, prompt, ticks, **config) for prompt, config in zip(PROMPTS, configs)]
    batch, got = batched(tiny, PROMPTS, configs, ticks, engine=engine)
    assert got == want
    if engine:
        assert batch.seated == [0, 1, 2] and len(batch.seats.engines) == 1 and batch.seats.rounds == ticks
        assert batch.meeting.forwards == 0
    else:
        assert batch.meeting.forwards == ticks and batch.meeting.fed == ticks * len(configs)
    for brain in batch.brains.values():
        brain.state.check(deep=True)


def test_sequences_join_and_leave_at_random_ticks_and_each_gets_its_own_tokens(tiny, alone):
    configs = [dict(budget=40 + 4 * k, seed=k, temperature=0.7, repairer="self" if k % 2 else "none")
               for k in range(len(PROMPTS))]
    ticks = [25, 18, 30, 12]
    want = [alone(tiny, prompt, n, **config) for prompt, n, config in zip(PROMPTS, ticks, configs)]
    joins = {0: [0, 1], 4: [2], 9: [3]}
    shuffle = random.Random(7)
    batch, got, clock = Batch(), {k: [] for k in range(len(PROMPTS))}, 0
    while clock < 60 and (len(batch) or any(at >= clock for at in joins)):
        for name in joins.get(clock, []):
            batch.join(name, started(tiny, PROMPTS[name], **configs[name]))
        order = list(batch.brains)
        shuffle.shuffle(order)  # who asks first does not matter
        records = batch.step()
        for name in order:
            got[name].append(records[name].token_id)
            if len(got[name]) == ticks[name]:
                batch.leave(name).state.check(deep=True)
        clock += 1
    assert [got[k] for k in range(len(PROMPTS))] == want


def test_a_fault_in_one_sequence_rebuilds_that_one_and_the_others_do_not_notice(tiny):
    """A fault half-way through the shared forward: that sequence's tick fails and rebuilds
    from its mirror (as alone), the forward is run again for the others, whose tokens and
    mirrors are those of an undisturbed run."""
    configs = [dict(budget=44, seed=k, temperature=0.9, repairer="self") for k in range(3)]
    ticks, fault_at = 24, 12
    undisturbed = [started(tiny, prompt, **config) for prompt, config in zip(PROMPTS, configs)]
    want = [[brain.step().token_id for _ in range(ticks)] for brain in undisturbed]
    batch = Batch()
    for name, (prompt, config) in enumerate(zip(PROMPTS, configs)):
        batch.join(name, started(tiny, prompt, **config))
    got = {name: [] for name in range(3)}
    for tick in range(ticks):
        if tick == fault_at:
            batch.brains[1].state.inject_fault("mid-forward")
        records = batch.step()
        for name, record in records.items():
            if name == 1 and tick == fault_at:
                assert record.rebuilt and "InjectedFault" in record.error
            else:
                assert not record.rebuilt, record.error
                got[name].append(record.token_id)
    assert batch.meeting.retries == 1
    for name in (0, 2):
        assert got[name] == want[name]
        assert mirror_pkg.to_bytes(batch.brains[name].state.mirror) == mirror_pkg.to_bytes(undisturbed[name].state.mirror)
    assert got[1][:fault_at] == want[1][:fault_at]
    batch.brains[1].state.check(deep=True)


def test_one_sequence_saved_and_resumed_mid_run_goes_on_as_if_never_stopped(tiny, tmp_path, alone):
    configs = [dict(budget=44, seed=k, temperature=0.9) for k in range(3)]
    want = [alone(tiny, prompt, 30, **config) for prompt, config in zip(PROMPTS, configs)]
    batch = Batch()
    for name, (prompt, config) in enumerate(zip(PROMPTS, configs)):
        batch.join(name, started(tiny, prompt, **config))
    got = {name: [] for name in range(3)}
    for tick in range(30):
        if tick == 14:  # save one while the others run, take it out, resume it from disk
            session.save(tmp_path / "one", batch.brains[1], "random:tiny")
            batch.leave(1)
            batch.join(1, session.resume(tiny, tmp_path / "one"))
        for name, record in batch.step().items():
            got[name].append(record.token_id)
    assert [got[name] for name in range(3)] == want


def test_a_batch_refuses_a_brain_of_another_model_and_a_taken_name(tiny, tiny_half):
    batch = Batch()
    batch.join("a", started(tiny, PROMPTS[0], budget=44))
    with pytest.raises(ValueError, match="already in the batch"):
        batch.join("a", started(tiny, PROMPTS[1], budget=44))
    with pytest.raises(ValueError, match="another model"):
        batch.join("b", started(tiny_half, PROMPTS[1], budget=44))
    assert list(batch.brains) == ["a"]
    with pytest.raises(KeyError, match="no sequence named z"):
        batch.step(force={"z": 5})


@pytest.mark.parametrize("kv_format", ["float", "int4h"])
def test_smartkv_with_recall_batched_gives_each_sequence_its_own_tokens(smol, alone, batched, kv_format):
    """The default policy on the embedded model (per-head lanes, recall, gates), in float rows
    and in int4h (each lane's keys read at its own positions): two sequences over their
    budgets, batched, make the tokens each makes alone."""
    text = ("The lighthouse keeper wrote in his log every evening; the code of the door was 4417. " * 6).strip()
    prompts = [smol.encode(text)[:120], smol.encode("Once upon a time, " * 20)[:100]]
    configs = [dict(policy="smartkv", recall=True, budget=96, seed=0, temperature=0, kv_format=kv_format),
               dict(policy="smartkv", recall=True, budget=80, seed=1, temperature=0.8, kv_format=kv_format)]
    ticks = 24
    want = [alone(smol, prompt, ticks, **config) for prompt, config in zip(prompts, configs)]
    batch, got = batched(smol, prompts, configs, ticks)
    assert got == want
    for brain in batch.brains.values():
        brain.state.check(deep=True)


def test_a_forward_through_rounds_from_outside_its_works_is_refused(tiny):
    """From another thread while it serves, or with nothing driving it: a forward no round
    would run is refused at once, and nothing is written."""
    import threading

    from positronic.batch import Rounds

    cache = SpliceCache(tiny.model.config, max_cache_len=32)
    prefill(tiny, cache, [1, 2, 3], [0, 1, 2])
    meeting = Rounds()
    with pytest.raises(RuntimeError, match="must come from a work"):
        meeting.forward(tiny, cache, [4], [3], [0, 1, 2, 3])
    ready = threading.Event()
    driver = threading.Thread(target=meeting.serve, kwargs={"starting": ready.set})
    driver.start()
    try:
        assert ready.wait(60)
        with pytest.raises(RuntimeError, match="must come from a work"):
            meeting.forward(tiny, cache, [4], [3], [0, 1, 2, 3])
    finally:
        meeting.stop()
        driver.join(60)
    assert cache.layers[0].length == 3 and not driver.is_alive()


@pytest.mark.parametrize("kv_format", ["int4", "int4h"])
def test_4_bit_formats_and_repairers_batched_give_each_sequence_its_own_tokens(tiny, kv_format, alone, batched):
    """A 4-bit cache writes its rows its own way (encoded) from the shared forward; a
    repairer's forward joins the batch (or, with probes, runs alone): tokens as alone."""
    configs = [dict(budget=44, seed=1, temperature=0.9, kv_format=kv_format),
               dict(budget=48, seed=2, temperature=0, kv_format=kv_format, repairer="self")]
    ticks = 24
    want = [alone(tiny, prompt, ticks, **config) for prompt, config in zip(PROMPTS, configs)]
    batch, got = batched(tiny, PROMPTS, configs, ticks)
    assert got == want
    for brain in batch.brains.values():
        brain.state.check(deep=True)


def test_a_shared_forward_run_again_first_takes_back_the_rows_it_appended(tiny):
    """What a retry relies on: appended rows are taken back (a filled gap is just written again)."""
    cache = SpliceCache(tiny.model.config, max_cache_len=32)
    prefill(tiny, cache, [1, 2, 3], [0, 1, 2])
    part = prepare(tiny, cache, [4, 5], [3, 4], [0, 1, 2, 3, 4])
    forward_many(tiny, [part])
    assert [layer.length for layer in cache.layers] == [5, 5]
    part.undo_appends()
    assert [layer.length for layer in cache.layers] == [3, 3]



def test_seated_sequences_records_and_forced_tokens_are_those_of_brains_alone(tiny):
    """In engine rounds, a tick's record has the token, its text, the tick and the live length
    a Brain's own tick records, and a forced token is read as `Brain.step(force)` reads it; a
    forced token outside the vocabulary is refused before anything ticks."""
    configs = [dict(policy="streaming", budget=40, temperature=0), dict(policy="h2o", budget=44, seed=4, temperature=0.9)]
    force = {5: {0: 17}, 9: {1: 300}, 10: {0: 3, 1: 4}}
    lone = [started(tiny, prompt, **config) for prompt, config in zip(PROMPTS, configs)]
    want = [[lone[n].step(force.get(t, {}).get(n)) for t in range(24)] for n in range(2)]
    batch = Batch()
    for name, (prompt, config) in enumerate(zip(PROMPTS, configs)):
        batch.join(name, started(tiny, prompt, **config))
    got = [[], []]
    for t in range(24):
        if t == 7:
            with pytest.raises(ValueError, match="forced token is an id in"):
                batch.step(force={0: tiny.vocab_size})
        for name, record in batch.step(force=force.get(t)).items():
            got[name].append(record)
    assert batch.seated == [0, 1] and batch.seats.rounds == 24
    for mine, theirs in zip(got, want):
        assert [(r.token_id, r.text, r.tick, r.live_length, r.rebuilt) for r in mine] == \
               [(r.token_id, r.text, r.tick, r.live_length, r.rebuilt) for r in theirs]
    brains = batch.brains  # handed back: their ledgers read as the lone brains'
    assert batch.seated == []
    for name in (0, 1):
        ledger, other = brains[name].state.mirror.ledger, lone[name].state.mirror.ledger
        assert [(e.token_id, e.source, e.text) for e in ledger] == [(e.token_id, e.source, e.text) for e in other]


def test_a_compiled_batch_seats_a_lone_brain_and_it_makes_its_engine_tokens(tiny):
    """`Batch(compiled=True)`: a compiled round of one is faster than a brain's own tick, so a
    lone brain takes a seat too; its tokens are those of a compiled engine of its own."""
    from positronic.batch.engine import Engine

    config = dict(policy="h2o", budget=40, temperature=0)
    batch = Batch(compiled=True)
    batch.join("a", started(tiny, PROMPTS[0], **config))
    got = [batch.step()["a"].token_id for _ in range(20)]
    assert batch.seated == ["a"] and batch.seats.rounds == 20 and batch.meeting.forwards == 0
    engine = Engine(tiny, slots=1, capacity=40, compiled=True)
    engine.join("a", started(tiny, PROMPTS[0], **config))
    assert got == [engine.step()["a"] for _ in range(20)]
    assert Batch(compiled=False).seats.compiled is False


def test_a_line_said_to_a_seated_brain_is_read_in_its_rounds_as_its_own_ticks_read_it(tiny):
    """`Brain.say` on a brain seated in an engine: its next rounds add the line's tokens (ledger
    source "user", the sampler unmoved), then it generates on, as alone; with `texts`, each
    record names the rows it took out with their texts, as a Brain's tick does."""
    configs = [dict(policy="brightness", budget=40, window=8, seed=3, temperature=0.8), dict(policy="streaming", budget=44, temperature=0)]
    lone = [started(tiny, prompt, **config) for prompt, config in zip(PROMPTS, configs)]
    seated = [started(tiny, prompt, **config) for prompt, config in zip(PROMPTS, configs)]
    batch = Batch(texts=True)
    for name, brain in enumerate(seated):
        batch.join(name, brain)
    want, got = [[], []], [[], []]
    for t in range(40):
        if t == 6:
            said = lone[0].say("the keeper")
            assert seated[0].say("the keeper") == said and len(said) > 2
        for name in (0, 1):
            want[name].append(lone[name].step())
        for name, record in batch.step().items():
            got[name].append(record)
    assert batch.seated == [0, 1], "the line was read in rounds"
    for mine, theirs in zip(got, want):
        assert [(r.token_id, r.source, r.text, r.tick) for r in mine] == \
               [(r.token_id, r.source, r.text, r.tick) for r in theirs]
        assert [sorted(map(repr, r.actions)) for r in mine] == [sorted(map(repr, r.actions)) for r in theirs]
        for a, b in zip(mine, theirs):  # a row's own decode: the ledger's text, but where a character spans tokens
            assert len(a.removed) == len(b.removed)
            assert all(x["text"] == y["text"] for x, y in zip(a.removed, b.removed) if "\ufffd" not in y["text"])
    assert sum(r.source == "user" for r in got[0]) == len(said) and any(r.removed for r in got[0])
    assert seated[0].pending_input == ()
    brains = batch.brains
    ledger, other = brains[0].state.mirror.ledger, lone[0].state.mirror.ledger
    assert [(e.token_id, e.source) for e in ledger] == [(e.token_id, e.source) for e in other]
