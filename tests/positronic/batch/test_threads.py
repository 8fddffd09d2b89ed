"""Which thread runs a batch's ticks and forwards, with how many of torch's threads, and how
works come and go while a Rounds serves (the server's forward thread).

On a CPU each thread that runs a parallel op gets OpenMP threads of its own, and once there
are more of them than cores every forward slows (a forward of 8 rows ran at 0.55x its speed
in a second thread on a 2-core box: positronic/batch/threads.py). So one thread drives the
rounds: its forwards with torch's threads, the ticks' own ops with one; a blocking part handed
to a helper thread runs with one.
"""

import asyncio
import contextlib
import threading
import time

import pytest
import torch

from positronic.batch import Batch, Rounds, WorkLock, offload, rounds, wait
from positronic.brain.loop import Brain, BrainConfig
from positronic.server.worker import ModelWorker
from positronic.state.forward import MEETING

from .test_batch import PROMPTS


def spy(monkeypatch, name: str, module=rounds) -> list[tuple[str, int]]:
    """Record the thread and its torch threads of every call of `module`.`name`."""
    calls, real = [], getattr(module, name)

    def spied(*args, **kwargs):
        calls.append((threading.current_thread().name, torch.get_num_threads()))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spied)
    return calls


@contextlib.contextmanager
def serving(rounds: Rounds):
    """`rounds` served by a thread of its own while the block runs; stopped, and the thread
    gone within two minutes, after it."""
    ready = threading.Event()
    thread = threading.Thread(target=rounds.serve, kwargs={"starting": ready.set}, name="driver")
    thread.start()
    assert ready.wait(60)
    try:
        yield
    finally:
        rounds.stop()
        thread.join(120)
    assert not thread.is_alive()


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
    """Every job is a work of the forward thread's Rounds: its forwards run there with the
    worker's threads (a model run that is not a forward of the brain too: a prompt's logprobs),
    its own ops with one."""
    shared = spy(monkeypatch, "forward_many")
    worker = ModelWorker(threads=2)

    async def run():
        brains = await asyncio.gather(*(worker.run(Brain.start, tiny, prompt, BrainConfig(budget=40, seed=k))
                                        for k, prompt in enumerate(PROMPTS)))
        for _ in range(6):
            await asyncio.gather(*(worker.run(brain.step) for brain in brains))
        # a model run that is not a forward of the brain (a prompt's logprobs) runs there too
        here = lambda: (threading.current_thread().name, torch.get_num_threads())  # noqa: E731
        return await worker.run(worker.meeting.call, here), await worker.run(here)

    try:
        called = asyncio.run(run())
    finally:
        worker.close()
    assert len(shared) > 6
    assert set(shared) == {("positronic-forward", 2)}
    assert called == (("positronic-forward", 2), ("positronic-forward", 1))  # a job's own ops with one
    assert not worker._forwards.is_alive()




def test_works_submitted_while_others_run_join_the_rounds_and_each_is_as_alone(tiny, alone):
    """A serving Rounds takes works from another thread at any time: a second sequence
    submitted after the first has begun joins its rounds (shared forwards), a third comes
    after both are done; every sequence's tokens are those alone."""
    configs = [dict(budget=44, seed=1, temperature=0), dict(budget=40, seed=2, temperature=0.8),
               dict(budget=40, seed=3, temperature=0)]
    ticks = 12
    want = [alone(tiny, prompt, ticks, **config) for prompt, config in zip(PROMPTS, configs)]
    brains = [Brain.start(tiny, prompt, BrainConfig(**config)) for prompt, config in zip(PROMPTS, configs)]
    begun = threading.Event()

    def tokens(number: int) -> list[int]:
        got = []
        for _ in range(ticks):
            got.append(brains[number].step().token_id)
            begun.set()
        return got

    meeting = Rounds()
    with serving(meeting):
        first = meeting.submit(lambda: tokens(0))
        assert begun.wait(60)
        second = meeting.submit(lambda: tokens(1))
        got = [first.result(120), second.result(120)]
        got.append(meeting.submit(lambda: tokens(2)).result(120))
        with pytest.raises(TypeError, match="Rounds.submit takes a callable of no arguments, got int"):
            meeting.submit(3)
    assert got == want
    assert meeting.fed > meeting.forwards  # the first two shared some rounds
    with pytest.raises(RuntimeError, match="not serving"):
        meeting.submit(lambda: None)


def test_a_work_that_offloads_a_blocking_part_holds_nobody_up_and_comes_back_as_alone(tiny, alone):
    """Sequence 0 ticks twice, then hands a part that blocks until sequence 1 has ticked 6
    times more to a helper thread (as a session writing its checkpoint does): those rounds go
    without it. Both then go on as alone."""
    configs = [dict(budget=44, seed=1, temperature=0), dict(budget=40, seed=2, temperature=0.8)]
    want = [alone(tiny, prompt, 10, **config) for prompt, config in zip(PROMPTS, configs)]
    brains = [Brain.start(tiny, prompt, BrainConfig(**config)) for prompt, config in zip(PROMPTS, configs)]
    aside, others_ticked, helper = threading.Event(), threading.Event(), []
    meeting = Rounds()

    def blocking() -> int:
        aside.set()
        helper.append((threading.current_thread().name, torch.get_num_threads()))
        assert others_ticked.wait(60), "the other sequence's rounds waited for the part offloaded"
        return meeting.forwards

    def first() -> tuple[list[int], int]:
        got = [brains[0].step().token_id for _ in range(2)]
        forwards = offload(blocking)
        got += [brains[0].step().token_id for _ in range(8)]
        return got, forwards

    def second() -> list[int]:
        got = [brains[1].step().token_id for _ in range(2)]
        assert offload(aside.wait, 60)  # until sequence 0's part has begun
        got += [brains[1].step().token_id for _ in range(6)]
        others_ticked.set()
        return got + [brains[1].step().token_id for _ in range(2)]

    got = meeting.run({0: first, 1: second})
    assert [got[0][0], got[1]] == want
    assert got[0][1] >= 8  # six rounds of sequence 1 alone went while sequence 0's part ran
    assert helper[0][0].startswith("positronic-aside") and helper[0][1] == 1


def _done():
    """A future that is already done (wait() on it returns at once)."""
    import concurrent.futures

    future = concurrent.futures.Future()
    future.set_result(None)
    return future


def test_a_reader_waiting_on_a_work_lock_gets_in_between_two_ticks_of_its_holder(tiny, alone):
    """A work that ticks under a WorkLock, tick after tick, and a reader that asks for the
    lock while a tick is paused at its forward: the reader gets it once that tick is over and
    before the next begins (it sees a whole tick count), and the ticks are as alone."""
    config = dict(budget=44, seed=1, temperature=0)
    want = alone(tiny, PROMPTS[0], 6, **config)
    brain = Brain.start(tiny, PROMPTS[0], BrainConfig(**config))
    lock, ticks, seen = WorkLock(), [], []

    def ticking() -> None:
        for _ in range(6):
            with lock:
                ticks.append(None)
                ticks[-1] = brain.step().token_id

    def reading() -> None:
        seen.append((lock.locked(), list(ticks)))  # the other work is paused inside its first tick
        with lock:
            seen.append((lock.locked(), list(ticks)))

    meeting = Rounds()
    got = meeting.run({"ticking": ticking, "reading": reading})
    assert got == {"ticking": None, "reading": None}
    assert ticks == want
    assert seen == [(True, [None]), (True, want[:1])]  # after the first tick, before the second
    assert not lock.locked()


def test_wait_and_offload_outside_a_work_are_plain_calls_and_a_work_lock_alone_is_a_lock():
    """Code that runs alone (no Rounds) keeps working: offload calls, wait blocks."""
    assert offload(lambda a, b: a + b, 2, b=3) == 5
    assert wait(_done()) is None
    lock = WorkLock()
    with lock:
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(RuntimeError, match="must come from a work"):
        Rounds().wait(_done().__class__())


def test_when_the_driving_fails_every_work_in_progress_fails_with_it_and_none_waits_for_ever(tiny):
    """A fault of the serving thread itself (here its forward callback): the works paused in
    its round, and those submitted after, fail with one line naming the cause; nothing hangs,
    and the Rounds takes no more works."""
    brains = [Brain.start(tiny, prompt, BrainConfig(budget=40, seed=k)) for k, prompt in enumerate(PROMPTS[:2])]

    def broken(sequences: int) -> None:
        raise OSError("the metrics' disk is gone")

    meeting, ready, failed = Rounds(on_forward=broken), threading.Event(), []

    def drive() -> None:
        try:
            meeting.serve(starting=ready.set)
        except OSError as error:
            failed.append(error)

    thread = threading.Thread(target=drive)
    thread.start()
    assert ready.wait(60)
    futures = [meeting.submit(brain.step) for brain in brains]
    for future in futures:
        with pytest.raises(RuntimeError, match="the rounds stopped: OSError: the metrics' disk is gone"):
            future.result(60)
    thread.join(60)
    assert not thread.is_alive() and len(failed) == 1
    with pytest.raises(RuntimeError, match="not serving"):
        meeting.submit(lambda: None)
