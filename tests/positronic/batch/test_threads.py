"""Which thread runs a batch's forwards, and with how many of torch's threads.

On a CPU each thread that runs a parallel op gets OpenMP threads of its own, and once there
are more of them than cores every forward slows (a forward of 8 rows ran at 0.55x its speed
in a second thread on a 2-core box: positronic/batch/rendezvous.py). So where sequences tick
in threads (the server's jobs) one thread, the runner, runs every forward with torch's
threads, and the sequences' threads keep to one; a Batch ticks in the caller's thread alone.
"""

import asyncio
import threading
import time

import pytest
import torch

from positronic.batch import Batch, Rendezvous, rendezvous, rounds
from positronic.brain.loop import Brain, BrainConfig
from positronic.server.sessions import ModelWorker
from positronic.state.forward import MEETING

from .test_batch import PROMPTS


def spy(monkeypatch, name: str, module=rendezvous) -> list[tuple[str, int]]:
    """Record the thread and its torch threads of every call of `module`.`name`."""
    calls, real = [], getattr(module, name)

    def spied(*args, **kwargs):
        calls.append((threading.current_thread().name, torch.get_num_threads()))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spied)
    return calls


def serve_threads(meeting: Rendezvous, targets, **serve) -> None:
    """Run each of `targets` in a sequence's thread, their forwards served by a runner thread
    (`serve` passed on: forever=True); every thread must end within two minutes."""
    meeting.expect(len(targets))
    threads = [threading.Thread(target=target) for target in targets]
    runner = threading.Thread(target=meeting.serve, kwargs={**serve, "starting": lambda: [t.start() for t in threads]})
    runner.start()
    for thread in [runner] + threads:  # the runner starts the others
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads + [runner])


def test_a_batchs_ticks_and_forwards_all_run_in_the_callers_thread_the_forwards_with_its_threads(tiny, monkeypatch):
    """Batch runs each tick as a greenlet of the caller's thread (positronic/batch/rounds.py):
    shared forwards and the forwards that run alone (a repairer's probes) with the caller's
    torch threads, the ticks' own ops with one (as a server job's thread); no thread is
    started, and afterwards the caller, and a thread yet to start, have the caller's count."""
    shared, solo = spy(monkeypatch, "forward_many"), spy(monkeypatch, "forward_alone", rounds)
    configs = [dict(budget=48, window=8, seed=1, temperature=0, repairer="bridge"), dict(budget=40, seed=2, temperature=0.8)]
    batch = Batch()
    seen = []
    for name, (prompt, config) in enumerate(zip(PROMPTS, configs)):
        brain = Brain.start(tiny, prompt, BrainConfig(**config))
        real_step = brain.step
        brain.step = lambda force=None, step=real_step: (
            seen.append((threading.current_thread().name, torch.get_num_threads())), step(force))[1]
        batch.join(name, brain)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # more than the ticks' one, wherever this runs (a lease's suite runs with one)
    try:
        caller = (threading.current_thread().name, 2)
        started = spy(monkeypatch, "start", threading.Thread)
        for _ in range(30):
            batch.step()
        monkeypatch.undo()
        assert shared and solo, "the run made no shared forward or no forward alone: it checks nothing"
        assert set(shared) == set(solo) == {caller}
        assert set(seen) == {(caller[0], 1)}
        assert not started and torch.get_num_threads() == 2
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [2]
    finally:
        torch.set_num_threads(previous)


def test_the_servers_forward_thread_keeps_its_threads_while_the_jobs_keep_to_one(tiny, monkeypatch):
    """torch sets a thread's count on its first parallel op from the count last set anywhere:
    the jobs set one, and the forward thread must still run with the worker's."""
    shared = spy(monkeypatch, "forward_many")
    worker = ModelWorker(threads=2)

    async def run():
        brains = await asyncio.gather(*(worker.run(Brain.start, tiny, prompt, BrainConfig(budget=40, seed=k))
                                        for k, prompt in enumerate(PROMPTS)))
        for _ in range(6):
            await asyncio.gather(*(worker.run(brain.step) for brain in brains))
        # a model run that is not a forward of the brain (a prompt's logprobs) runs there too
        return await worker.run(worker.meeting.call, lambda: (threading.current_thread().name, torch.get_num_threads()))

    try:
        called = asyncio.run(run())
    finally:
        worker.close()
    assert len(shared) > 6
    assert set(shared) == {("positronic-forward", 2)} and called == ("positronic-forward", 2)
    assert not worker._forwards.is_alive()


def test_when_the_runner_stops_the_sequences_run_their_rounds_themselves(tiny, alone):
    """The runner leaves after its first round (as an exception would take it away): the
    sequences' ticks go on, each exactly as alone."""
    configs = [dict(budget=44, seed=1, temperature=0), dict(budget=40, seed=2, temperature=0.8)]
    ticks = 20
    want = [alone(tiny, prompt, ticks, **config) for prompt, config in zip(PROMPTS, configs)]
    brains = [Brain.start(tiny, prompt, BrainConfig(**config)) for prompt, config in zip(PROMPTS, configs)]
    meeting = Rendezvous(on_forward=lambda sequences: meeting.stop())
    got = [[] for _ in brains]

    def tick(number: int) -> None:
        MEETING.set(meeting)
        try:
            got[number] = [brains[number].step().token_id for _ in range(ticks)]
        finally:
            meeting.done()

    serve_threads(meeting, [lambda number=number: tick(number) for number in range(len(brains))], forever=True)
    assert got == want
    assert meeting.forwards == ticks


@pytest.mark.parametrize("threads", [0, -2, 1.5, True])
def test_a_worker_with_a_bad_thread_count_is_refused_at_once(threads):
    """One line naming the setting, before any thread starts (a forward thread that failed on
    it would have left the server waiting for it for ever)."""
    alive = threading.active_count()
    with pytest.raises(ValueError, match="threads must be a whole number of at least 1"):
        ModelWorker(threads=threads)
    assert threading.active_count() == alive


def test_a_sequence_stepped_aside_holds_up_nobody_and_comes_back_as_alone(tiny, alone):
    """Sequence 0 ticks, then steps aside (as a session writing its checkpoint does) until
    sequence 1 has ticked 6 times more: those rounds go without it. A forward made while
    aside runs alone; both then go on as alone."""
    configs = [dict(budget=44, seed=1, temperature=0), dict(budget=40, seed=2, temperature=0.8)]
    want = [alone(tiny, prompt, 10, **config) for prompt, config in zip(PROMPTS, configs)]
    brains = [Brain.start(tiny, prompt, BrainConfig(**config)) for prompt, config in zip(PROMPTS, configs)]
    meeting, away, others_ticked, back = Rendezvous(), threading.Event(), threading.Event(), threading.Event()
    got, shared_while_away = [[], []], []

    def first() -> None:
        MEETING.set(meeting)
        try:
            got[0] += [brains[0].step().token_id for _ in range(2)]
            with meeting.aside():
                away.set()
                assert others_ticked.wait(60), "the other sequence's rounds waited for the one stepped aside"
                shared_while_away.append(meeting.forwards)
                got[0].append(brains[0].step().token_id)  # alone, in this thread
                assert meeting.forwards == shared_while_away[0]
            back.set()
            got[0] += [brains[0].step().token_id for _ in range(7)]
        finally:
            back.set()
            meeting.done()

    def second() -> None:
        MEETING.set(meeting)
        try:
            got[1] += [brains[1].step().token_id for _ in range(2)]
            assert away.wait(60)
            got[1] += [brains[1].step().token_id for _ in range(6)]
            others_ticked.set()
            assert back.wait(60)
            got[1] += [brains[1].step().token_id for _ in range(2)]
        finally:
            others_ticked.set()
            meeting.done()

    serve_threads(meeting, [first, second])
    assert got == want
    assert meeting.fed > meeting.forwards  # the others' rounds were shared before and after


def test_a_round_does_not_linger_for_a_sequence_gone_away(tiny):
    """With a long linger, a round waits for a sequence of the last round that is not back
    yet; one that said it is `away` (a server session whose reply is over) is not waited for."""
    brains = [Brain.start(tiny, prompt, BrainConfig(budget=40, seed=k)) for k, prompt in enumerate(PROMPTS[:2])]
    meeting, seconds = Rendezvous(linger=5.0), []

    def leaving() -> None:
        MEETING.set(meeting)
        try:
            for _ in range(2):
                brains[0].step()
            meeting.away()
        finally:
            meeting.done()

    def staying() -> None:
        MEETING.set(meeting)
        try:
            for _ in range(6):
                start = time.monotonic()
                brains[1].step()
                seconds.append(time.monotonic() - start)
        finally:
            meeting.done()

    serve_threads(meeting, [leaving, staying])
    assert len(seconds) == 6 and max(seconds) < 4.0, f"a round waited for the sequence gone away: {seconds}"


def test_aside_from_a_thread_nobody_counted_is_refused_and_alone_it_is_nothing():
    meeting = Rendezvous()
    with pytest.raises(RuntimeError, match="aside\\(\\) from a thread the rendezvous was not told of"):
        with meeting.aside():
            pass
    assert meeting._working == 0  # nothing changed
    with rendezvous.aside():  # this thread ticks alone (no MEETING): nothing to step aside from
        rendezvous.away()
