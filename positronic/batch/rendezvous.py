"""Where the ticks of several sequences meet for one forward.

Each sequence ticks in a thread of its own, exactly as it would alone: its policy, its edits,
its mirror. A thread whose `MEETING` is a Rendezvous hands every model forward it makes (a
tick's, a prefill's chunks) to it and waits. Once every sequence at work is either waiting
here or done, the waiting forwards run as one (`forward_many`), in the runner's thread (below);
each sequence then goes on with its own result. Python work is serialised by the GIL
as it would be anyway; the forward, which reads every weight once for all of them, is shared.

A shared forward that fails is run again one sequence at a time (appended rows taken back
first; rows written into a splice's gaps are simply written again), so only the sequence at
fault sees the error, and rebuilds itself as it would alone. A forward that cannot be shared
(probes, the ring store) runs alone, at once (`call`). A sequence that will make no forward for
a while (a server session writing its checkpoint) steps `aside()`: rounds go without it.

Who runs the forwards. With a runner (a thread in `serve()`: `Batch.step`'s caller, the
server's forward thread) every forward, shared or alone, runs in that one thread with torch's
threads, and the sequences' threads keep to one (`threads.one_thread`, which says why: a
forward of 8 rows ran at 0.55x its speed otherwise). Without a runner, the last thread to
arrive runs the round. The numbers are the same either way.

`linger` (seconds): how long a round waits, once nobody is at work, for the sequences of the
previous round that have not come back yet (a server's requests come back for their next token through its event loop;
without it each round would go with whoever happened to be first). A round never waits for
anyone while a sequence is still at work: it cannot run before they are all waiting anyway.

    meeting = Rendezvous()
    meeting.expect(2)                       # before the sequences' threads start
    # in each thread:  MEETING.set(meeting); with threads.one_thread(2): brain.step(); meeting.done()
    meeting.serve(starting=start_threads)   # here: run their forwards until both are done
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..state.forward import MEETING, ForwardResult, Prepared, forward_alone, prepare
from ..state.batched import SHARED_PREFILL_CHUNK, forward_many, shareable


class _Ticket:
    """One sequence's forward (`part`), or any other model run (`work`), waiting for its turn;
    then its result, or the error it raised."""

    def __init__(self, lm=None, part: Prepared | None = None, work: Callable[[], object] | None = None):
        self.lm, self.part, self.work, self.done = lm, part, work, False
        self.result: object = None
        self.error: BaseException | None = None

    def finish(self, outcome) -> None:
        """Its result, or the Failed that holds its error."""
        if isinstance(outcome, Failed):
            self.error = outcome.error
        else:
            self.result = outcome
        self.done = True

    def outcome(self):
        if self.error is not None:
            raise self.error
        return self.result


@dataclass
class Failed:
    """The error a sequence's forward raised, in place of its result."""

    error: BaseException


class Rendezvous:
    """Counts the sequences at work (not waiting here, not done) and runs the waiting forwards
    together when none is (see the module docstring)."""

    def __init__(self, *, linger: float = 0.0, prefill_chunk: int = SHARED_PREFILL_CHUNK,
                 on_forward=lambda sequences: None):
        self.linger, self.prefill_chunk, self.on_forward = linger, prefill_chunk, on_forward
        self._turn = threading.Condition()
        self._working = 0
        self._waiting: list[_Ticket] = []
        self._idle_since: float | None = None  # when everyone at work came to wait, some of the last round missing
        self._last: set[int] = set()  # the caches the last round fed
        self._fed: dict[int, int] = {}  # thread -> the cache its last forward fed (for `away`)
        self._alone: list[_Ticket] = []  # forwards that cannot be shared, for the runner to run at once
        self._runner: int | None = None  # the thread in serve(), if any
        self._stop = False
        self._running = False  # a forward is running (the lock let go meanwhile)
        self.forwards = 0  # shared forwards run
        self.fed = 0  # sequences they fed
        self.retries = 0  # shared forwards that failed and were run again one sequence at a time

    def expect(self, count: int = 1) -> None:
        """`count` more sequences are at work (call before their threads start)."""
        with self._turn:
            self._working += count

    def done(self) -> None:
        """A sequence's work is over (finished or failed)."""
        with self._turn:
            self._fed.pop(threading.get_ident(), None)
            self._working -= 1
            if self._working <= 0:  # only then can a round go (or the runner leave)
                self._turn.notify_all()

    def away(self) -> None:
        """The calling thread's sequence will not be back for a while (a server session's reply
        is over): the next round does not linger for it."""
        with self._turn:
            self._last.discard(self._fed.get(threading.get_ident()))

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """The calling sequence steps aside for a while: it makes no forward until the block
        ends (a checkpoint being written), and the others' rounds go without it meanwhile.
        Counted at work again afterwards. A forward inside the block would not meet the others':
        it runs alone, in this thread (the thread's `MEETING` is cleared meanwhile).
        RuntimeError, and nothing changes, if nobody is counted at work (a thread the
        rendezvous was not told of)."""
        with self._turn:
            if self._working <= 0:
                raise RuntimeError("aside() from a thread the rendezvous was not told of (call expect() before the "
                                   "thread starts)")
        self.done()
        token = MEETING.set(None)
        try:
            yield
        finally:
            MEETING.reset(token)
            self.expect()

    def forward(self, lm, cache, token_ids: list[int], positions: list[int], key_positions: list[int], *,
                attention_layers: list[int] | None = None, probes=None, weights: bool = True) -> ForwardResult:
        """`state.forward.forward`'s contract, shared with the other sequences at work."""
        if not shareable(cache, probes):
            return self.call(forward_alone, lm, cache, token_ids, positions, key_positions,
                             attention_layers=attention_layers, probes=probes, weights=weights)
        ticket = _Ticket(lm, prepare(lm, cache, token_ids, positions, key_positions, attention_layers=attention_layers,
                                     weights=weights))
        with self._turn:
            if self._working <= 0:  # it would wait for a round nobody counts it in
                raise RuntimeError("a forward from a thread the rendezvous was not told of (call expect() before "
                                   "the thread starts)")
            self._waiting.append(ticket)
            self._fed[threading.get_ident()] = id(cache)
            self._working -= 1
            if self._working == 0:  # the round can go: waking every waiter at each arrival cost
                self._turn.notify_all()  # 7% of the sequences' GIL time at 8 (each woke to wait again)
            while not ticket.done:
                if self._runner is not None:
                    self._turn.wait()
                elif (wait := self._wait()) == 0:
                    self._run()
                else:
                    self._turn.wait(wait)
        return ticket.outcome()

    def call(self, function: Callable, *args, **kwargs):
        """`function(*args, **kwargs)` in the runner, at once, not in a round: a model run that
        cannot be shared (a forward with probes or over a ring store; a prompt's logprobs).
        Without a runner, in this thread."""
        if self._runner is None:
            return function(*args, **kwargs)
        ticket = _Ticket(work=lambda: function(*args, **kwargs))
        with self._turn:
            self._alone.append(ticket)
            self._turn.notify_all()
            while not ticket.done:
                if self._runner is not None:
                    self._turn.wait()
                else:  # the runner left before running it
                    self._alone.remove(ticket)
                    ticket.finish(self._unlocked(_alone, ticket))
        return ticket.outcome()

    def serve(self, *, forever: bool = False, starting: Callable[[], None] = lambda: None) -> None:
        """Run every forward in this thread (the runner), until nobody is at work and none is
        waiting (`forever`: until `stop()`). `starting()` is called once this thread is the
        runner: start the sequences' threads there, or a round could go before the runner is
        in (run by a sequence's thread, with its one thread). On the way out, even by an
        exception, the sequences' threads go back to running their rounds themselves."""
        with self._turn:
            if self._runner is not None:
                raise RuntimeError("the rendezvous already has a runner")
            self._runner, self._stop = threading.get_ident(), False
            try:
                starting()
                while not self._stop:
                    if self._alone and not self._running:
                        ticket = self._alone.pop(0)
                        ticket.finish(self._unlocked(_alone, ticket))
                        self._turn.notify_all()
                        continue
                    wait = self._wait()
                    if wait == 0:
                        self._run()
                    elif not (forever or self._working or self._waiting or self._running):
                        return
                    else:
                        self._turn.wait(wait)
            finally:
                self._runner = None
                self._turn.notify_all()

    def stop(self) -> None:
        """The runner (`serve(forever=True)`) returns once its round, if any, is over."""
        with self._turn:
            self._stop = True
            self._turn.notify_all()

    def _wait(self) -> float | None:
        """(Holding the lock.) 0: run the round now; else how long to wait (None: until told).
        The linger counts from the moment nobody is at work: before that the round could not
        run anyway, and a sequence still at work is no reason to give up on one coming back."""
        if self._running or self._working or not self._waiting:
            self._idle_since = None
            return None
        missing = self._last - {id(ticket.part.cache) for ticket in self._waiting}
        if not missing or not self.linger:
            return 0
        if self._idle_since is None:
            self._idle_since = time.monotonic()
        return max(0.0, self._idle_since + self.linger - time.monotonic())

    def _run(self) -> None:
        """(Holding the lock, which it lets go while the forward runs.) Every waiting forward as one."""
        tickets, self._waiting = self._waiting, []
        results = self._unlocked(self._forward, tickets)
        self.forwards += 1
        self.fed += len(tickets)
        self._idle_since = None
        self.on_forward(len(tickets))
        self._last = {id(ticket.part.cache) for ticket in tickets}
        for ticket, result in zip(tickets, results):
            ticket.finish(result)
        self._working += len(tickets)  # at work again from now, not from when each thread wakes: else
        self._turn.notify_all()        # the first to come back could go in a round of its own

    def _forward(self, tickets: list[_Ticket]) -> list:
        """Each ticket's ForwardResult, or Failed."""
        results, retried = shared_forward(tickets[0].lm, [ticket.part for ticket in tickets])
        self.retries += retried
        return results

    def _unlocked(self, function, *args):
        """(Holding the lock.) `function(*args)` with the lock let go: the threads that arrive
        meanwhile, and the server's event loop that counts a new job in (`expect`), do not wait
        for the forward. No other round starts meanwhile (`_running`)."""
        self._running = True
        self._turn.release()
        try:
            return function(*args)
        finally:
            self._turn.acquire()
            self._running = False


def aside():
    """`Rendezvous.aside` of this thread's meeting (`MEETING`); nothing when it ticks alone."""
    meeting = MEETING.get()
    return contextlib.nullcontext() if meeting is None else meeting.aside()


def away() -> None:
    """`Rendezvous.away` of this thread's meeting (`MEETING`); nothing when it ticks alone."""
    if (meeting := MEETING.get()) is not None:
        meeting.away()


def shared_forward(lm, parts: list[Prepared]) -> tuple[list, bool]:
    """One `forward_many` over `parts`: each part's ForwardResult, or the Failed that holds its
    error. If the shared forward fails, each part runs again on its own (its appended rows
    taken back first; rows written into a splice's gaps are simply written again), so only the
    sequence at fault fails. Also returns whether that retry happened."""
    try:
        return forward_many(lm, parts), False
    except BaseException as error:
        if len(parts) == 1:
            return [Failed(error)], False
        return [_part_alone(lm, part) for part in parts], True


def _part_alone(lm, part: Prepared):
    try:
        part.undo_appends()
        return forward_many(lm, [part])[0]
    except BaseException as error:
        return Failed(error)


def _alone(ticket: _Ticket):
    """A ticket's `work` run on its own: its result, or Failed."""
    try:
        return ticket.work()
    except BaseException as error:
        return Failed(error)
