"""Replies ticked as rounds of Core v4's engine (ServerSettings.engine_slots, `serve --engine`):
the same answers as every session ticking its own brain, through concurrent clients that lose
answers and retry them (a reply left half-way goes back to its brain and comes again)."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from positronic.batch.engine import Engine
from positronic.brain.loop import BrainConfig
from positronic.smartkv.gates import bench_gates
from tests.positronic.server.test_kill_soak import CONFIG, clients, converse


def answers(tiny, tmp_path, live_server, server_settings, engine_slots: int, config=CONFIG, compiled=False):
    talking = clients()  # a greedy chat, a seeded sampled chat, greedy completions; a quarter of the answers lost
    # compiled: the forwards with 2 torch threads, the jobs with 1 (a graph is made per thread count)
    extra = dict(engine_compiled=True, threads=2) if compiled else {}
    with live_server(tiny, server_settings(tmp_path / f"slots-{engine_slots}-{compiled}", engine_slots=engine_slots,
                                           engine_smartkv=True, **extra), config, start_s=300) as server:
        if compiled:  # made before serving (Engine.warm): a round of any size makes none again
            warmed = server.server.worker.seats.engines[0].state.compiled.compiles
        converse(lambda: server.url, talking, threading.Event())
        rounds = server.server.worker.engine_rounds
        generated = server.metric("positronic_generated_tokens_total")
        if compiled:  # the rounds ran the compiled graph, not the eager forward
            engines = server.server.worker.seats.engines
            assert len(engines) == 1 and engines[0].state.compiled.compiles == warmed > 0
    assert not any(client.failures for client in talking), [client.failures for client in talking]
    return {client.session: client.answers for client in talking}, rounds, generated, \
        sum(client.attempts - len(client.answers) for client in talking)


@pytest.mark.parametrize("policy", ["brightness", "smartkv"])
def test_replies_in_engine_rounds_are_the_replies_of_brains_ticking_alone(tiny, tmp_path, live_server,
                                                                         server_settings, policy):
    """The random model's default, and the embedded model's (smartkv with recall, ranked by
    recent use: its lanes keep their own rows) with untrained gates."""
    config = CONFIG
    if policy == "smartkv":
        _, gates = bench_gates(tiny, tmp_path)
        config = dataclasses.replace(CONFIG, policy="smartkv", recall=True, reread=False, memory_rank="recent",
                                     gates=gates, window=48)
    alone, rounds_alone, generated_alone, _ = answers(tiny, tmp_path, live_server, server_settings, 0, config)
    batched, rounds, generated, retried = answers(tiny, tmp_path, live_server, server_settings, 16, config)
    assert rounds_alone == 0 and rounds > 0
    assert retried > 0, "no answer was lost and asked again: the test would not see a reply leave half-way"
    assert batched == alone
    assert generated == generated_alone


def test_replies_in_compiled_engine_rounds_are_the_replies_of_eager_rounds(tiny, tmp_path, live_server,
                                                                          server_settings):
    """`serve --compile`: the same answers through the compiled round as through the eager one
    (on this model its float reordering flips no token), lost answers asked again included."""
    eager, rounds_eager, _, _ = answers(tiny, tmp_path, live_server, server_settings, 16)
    compiled, rounds, _, retried = answers(tiny, tmp_path, live_server, server_settings, 16, compiled=True)
    assert rounds > 0 and rounds_eager > 0 and retried > 0
    assert compiled == eager


@pytest.mark.parametrize("setting", ["repairer", "smartkv"])
def test_settings_the_engine_does_not_run_tick_alone(tiny, tmp_path, live_server, server_settings, chat,
                                                    monkeypatch, setting):
    """A repairer (not on Core v4 yet), and SmartKV unless engine_smartkv asks for it, keep a
    session on its own brain; it still answers, and no engine's buffers are made for it."""
    from positronic.batch import seats

    made = []
    monkeypatch.setattr(seats, "Engine", lambda *args, **kwargs: made.append(1) or Engine(*args, **kwargs))
    config = BrainConfig(budget=96, temperature=0.0, seed=0, repairer="self")
    if setting == "smartkv":
        config = dataclasses.replace(CONFIG, policy="smartkv", recall=True, reread=False,
                                     gates=bench_gates(tiny, tmp_path)[1], window=48)
    with live_server(tiny, server_settings(tmp_path, engine_slots=16), config) as server:
        for turn in range(2):
            reply = chat(server.client(), "r1", f"hello {turn}", max_tokens=6)
            assert reply.usage.completion_tokens == 6
        assert server.server.worker.engine_rounds == 0
    assert made == []


def test_engine_slots_must_be_a_whole_number():
    from positronic.server.worker import ModelWorker

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="engine_slots must be a whole number"):
            ModelWorker(engine_slots=bad)
