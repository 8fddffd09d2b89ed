"""Several sequences' ticks in one thread, round by round: each sequence's work is a greenlet
that pauses at every model forward it makes.

Each brain ticks exactly as it would alone (its policy, its edits, its mirror) until it asks
for a model forward (`state.forward.forward`, through `MEETING`); its greenlet then pauses
with the prepared part. Once every work is paused or done, the paused parts go through one
`forward_many` per model (`shared_forward`: a failed shared forward is run again one sequence
at a time, so only the sequence at fault fails), and each greenlet resumes with its own
result. A prompt's chunks are forwards like a tick's, so a sequence that starts its prompt
pauses once per chunk while the others tick.

Two ways to drive it:
- `run(works)`: these works to their end, in the calling thread (`Batch.step`).
- `serve()`: a thread of its own runs works that any thread `submit`s, each as soon as it
  comes, until `stop()` (the server's forward thread: a session's request is one work).

A work whose sequence is in a Core v4 engine (positronic/batch/engine.py; the server's replies)
pauses at `tick(engine, key)` instead: the engine's round runs once every one of its sequences'
works waits for it (a round ticks them all), beside the shared forwards of the works that tick
their own brains, and each work resumes with its sequence's token.

A work that must block (a checkpoint written to disk) hands that part to a helper thread,
`offload(fn)`, and pauses until it is done: the others' rounds go on meanwhile. `wait(future)`
pauses a work until a future is done (`WorkLock` is built on it).

Why not a thread per sequence. Every torch call lets the GIL go, so B threads hand it over at
every small op of every tick, and each sequence's host work cost 2-3x its time alone
(random:tiny on the CPU: 1.6 ms a tick alone, 3.1 at B = 8, 4.4 at B = 32). In one thread a
switch is a greenlet's, at the forward only. bench/results/history/batch.md, 2026-11-30, the same
brains and tokens: random:tiny's rounds about 2x faster at B = 8 and 32; SmolLM2's at B = 8
the same within this host's noise (its forward, not the ticks, is most of a round there).
The server's jobs (threads until 2026-11-30), random:tiny at 8 clients: 37-47% more
tokens/s, the p50 of a request 30% lower; SmolLM2 the same within noise. Where the host bounds
a round, as on a GPU, that is what batching gains.

The ticks' own ops run with one torch thread, the forwards (shared, or alone: probes, the
ring store, `call`) with the driving thread's count (threads.py says why one process wants
one OpenMP pool busy at a time). With two threads for the ticks' ops too, SmolLM2's default
policy ran its rounds at B = 8 20% slower: its ticks' mid-sized ops (recall's scan of its
index) then waited on OpenMP's second thread.

torch's grad mode is the thread's, and greenlets share the thread: each greenlet starts in
the driver's mode and gets its own back after every pause, and the driver's is restored after
every switch back to it. (Nothing in a tick pauses inside `torch.inference_mode`, whose guards
could not be swapped this way.)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import queue
import threading
from collections import deque
from collections.abc import Callable, Hashable

import torch
from greenlet import getcurrent, greenlet

from ..state.batched import SHARED_PREFILL_CHUNK, forward_many, shareable
from ..state.forward import MEETING, ForwardResult, Prepared, forward_alone, prepare
from .threads import set_threads

HELPERS = 4  # threads for offloaded parts (checkpoints being written), per Rounds


class _Pause:
    """A work waiting for its part's forward."""

    __slots__ = ("lm", "part")

    def __init__(self, lm, part):
        self.lm, self.part = lm, part


class _Tick:
    """A work waiting for its sequence's token from an engine's next round (`given`: the token
    and ledger source it adds instead of drawing one)."""

    __slots__ = ("engine", "key", "given")

    def __init__(self, engine, key, given=None):
        self.engine, self.key, self.given = engine, key, given


class _Wait:
    """A work waiting for a future (an offloaded part, a WorkLock's turn)."""

    __slots__ = ("future",)

    def __init__(self, future: concurrent.futures.Future):
        self.future = future


class _Done:
    """A work's end: what it returned, or the Exception it raised."""

    __slots__ = ("result", "error")

    def __init__(self, result=None, error: Exception | None = None):
        self.result, self.error = result, error


class _Work:
    """A callable to run as a greenlet, its caller's context, and the future of its outcome."""

    __slots__ = ("fn", "context", "future", "let")

    def __init__(self, fn: Callable[[], object], future: concurrent.futures.Future):
        self.fn, self.future, self.let = fn, future, None
        self.context = contextvars.copy_context()  # what the caller had set, as a plain call sees it


class Rounds:
    """Runs works (a brain's ticks each) as greenlets of one thread, their forwards shared
    round by round (see the module docstring): one forward per model a round. `MEETING` is
    set to it inside each work. `on_forward(sequences)` after each shared forward."""

    def __init__(self, *, prefill_chunk: int = SHARED_PREFILL_CHUNK,
                 on_forward: Callable[[int], None] = lambda sequences: None):
        self.prefill_chunk = prefill_chunk  # a prompt's tokens a forward carries beside the others' ticks
        self.on_forward = on_forward
        self.forwards = 0  # shared forwards run
        self.fed = 0  # sequences they fed
        self.retries = 0  # shared forwards that failed and were run again one sequence at a time
        self._driver: greenlet | None = None  # the greenlet in `run` or `serve`
        self._cores = 1  # the driving thread's torch threads, which the forwards run with (the ticks with one)
        self._grad = True  # the driving thread's grad mode
        self._inbox: queue.SimpleQueue[_Work] = queue.SimpleQueue()  # works submitted, not started
        self._wake = threading.Event()  # set when a work is submitted or a waited-for future is done
        self._paused: dict[_Work, _Pause] = {}
        self._waiting: dict[_Work, concurrent.futures.Future] = {}
        self._running: set[_Work] = set()  # started, not done
        self._serving = False
        self._stopping = False
        self._door = threading.Lock()  # submit's check and put, against serve's end
        self._helpers: concurrent.futures.ThreadPoolExecutor | None = None

    # -- driving -------------------------------------------------------------------------

    def run(self, works: dict[Hashable, Callable[[], object]]) -> dict[Hashable, object]:
        """Each `work()` to its end, in this thread; returns what each returned, or the
        Exception it raised (the others go on unaffected). RuntimeError if called from inside
        a work, or while this Rounds serves."""
        if self._driver is not None:
            raise RuntimeError("Rounds.run is already running: a sequence's work cannot start a round of its own")
        if not isinstance(works, dict) or not all(callable(work) for work in works.values()):
            raise TypeError(f"Rounds.run takes a dict of name -> callable of no arguments, got {type(works).__name__}"
                            + (" with a value that is not callable" if isinstance(works, dict) else ""))
        futures = {name: concurrent.futures.Future() for name in works}
        for name, work in works.items():
            self._inbox.put(_Work(work, futures[name]))
        self._drive(lambda: all(future.done() for future in futures.values()))
        return {name: future.exception() or future.result() for name, future in futures.items()}

    def serve(self, *, starting: Callable[[], None] = lambda: None) -> None:
        """Run every submitted work in this thread until `stop()`, and then until those in
        progress are done. `starting()` once it is ready for works."""
        if self._driver is not None or self._serving:
            raise RuntimeError("this Rounds is already being driven")
        self._serving, self._stopping = True, False
        try:
            starting()
            self._drive(lambda: self._stopping and not self._running and self._inbox.empty())
        except BaseException as error:  # a fault of the driving itself: no work may wait for ever
            self._abandon(error)
            raise
        finally:
            with self._door:
                self._serving = False
            self._abandon(RuntimeError("it was stopped"))  # works submitted as it ended: none left waiting
            if self._helpers is not None:
                self._helpers.shutdown(wait=False)
                self._helpers = None

    def _abandon(self, error: BaseException) -> None:
        """Every work not done fails with RuntimeError naming `error` (their greenlets are
        dropped unfinished)."""
        self._stopping = True
        failure = RuntimeError(f"the rounds stopped: {type(error).__name__}: {error}")
        works = list(self._running)
        self._paused, self._waiting, self._running = {}, {}, set()
        while not self._inbox.empty():
            works.append(self._inbox.get_nowait())
        for work in works:
            if not work.future.done():
                work.future.set_exception(failure)

    def submit(self, work: Callable[[], object]) -> concurrent.futures.Future:
        """`work()` in the serving thread, as a work of the next round (from any thread); its
        outcome in the future. A future cancelled before the work starts skips it.
        RuntimeError if nothing serves."""
        if not callable(work):
            raise TypeError(f"Rounds.submit takes a callable of no arguments, got {type(work).__name__}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._door:
            if not self._serving or self._stopping:
                raise RuntimeError("this Rounds is not serving (serve() is not running, or stop() was called)")
            self._inbox.put(_Work(work, future))
        self._wake.set()
        return future

    def stop(self) -> None:
        """`serve()` returns once the works in progress are done (from any thread)."""
        self._stopping = True
        self._wake.set()

    def _drive(self, over: Callable[[], bool]) -> None:
        """Start new works, resume those whose wait is over, run the round's forwards, until
        `over()`; sleeps while every work waits on something else."""
        self._driver = getcurrent()
        self._grad = torch.is_grad_enabled()
        self._cores = torch.get_num_threads()
        try:
            set_threads(1)
            while not over():
                self._wake.clear()
                moved = self._start_new() + self._resume_waited()
                ran = self._round() if self._paused else False
                if not ran and not moved and not over():
                    self._wake.wait()  # every work waits on something else (a tick's fellows among them)
        finally:
            self._driver = None
            torch.set_grad_enabled(self._grad)
            torch.set_num_threads(self._cores)

    def _start_new(self) -> int:
        started = 0
        while True:
            try:
                work = self._inbox.get_nowait()
            except queue.Empty:
                return started
            if not work.future.set_running_or_notify_cancel():
                continue
            work.let = greenlet(self._body(work))
            work.let.gr_context = work.context
            self._running.add(work)
            self._went(work, work.let.switch())
            started += 1

    def _body(self, work: _Work) -> Callable[[], _Done]:
        def body() -> _Done:
            MEETING.set(self)
            try:
                return _Done(result=work.fn())
            except Exception as error:  # this sequence's failure: the others go on
                return _Done(error=error)

        return body

    def _resume_waited(self) -> int:
        ready = [work for work, future in self._waiting.items() if future.done()]
        for work in ready:
            self._went(work, work.let.switch(self._waiting.pop(work)))
        return len(ready)

    def _round(self) -> bool:
        """The paused works' forwards, one per model, and the round of every engine whose
        sequences' works all wait for it; then each work resumed with its result. Returns
        whether anything ran (an engine waits while a work of one of its sequences waits on
        something else: its round would tick that sequence too)."""
        paused, self._paused = self._paused, {}
        groups: dict[int, list[_Work]] = {}
        engines: dict[int, list[_Work]] = {}
        for work, pause in paused.items():
            if isinstance(pause, _Tick):
                engines.setdefault(id(pause.engine), []).append(work)
            else:
                groups.setdefault(id(pause.lm), []).append(work)
        results = {}
        with self._forward_threads():
            for works in groups.values():  # one forward feeds one model
                shared, retried = shared_forward(paused[works[0]].lm, [paused[work].part for work in works])
                results.update(zip(works, shared))
                self.forwards += 1
                self.fed += len(works)
                self.retries += retried
                self.on_forward(len(works))
            for works in engines.values():
                engine = paused[works[0]].engine
                if {paused[work].key for work in works} != set(engine.keys()):
                    self._paused.update((work, paused[work]) for work in works)  # not yet: a fellow is elsewhere
                    continue
                given = {paused[work].key: paused[work].given for work in works if paused[work].given is not None}
                try:
                    made = engine.step(given)
                    outcomes = [made.get(paused[work].key) for work in works]  # None: its round failed (rebuilt)
                except Exception as error:
                    outcomes = [Failed(error)] * len(works)
                results.update(zip(works, outcomes))
                self.forwards += 1
                self.fed += len(works)
                self.on_forward(len(works))
        for work, result in results.items():
            self._went(work, work.let.switch(result))
        return bool(results)

    def _went(self, work: _Work, where) -> None:
        """A work switched back: paused at a forward, waiting, or done. The driver's grad mode
        again (the next greenlet to start starts in it)."""
        torch.set_grad_enabled(self._grad)
        if isinstance(where, (_Pause, _Tick)):
            self._paused[work] = where
        elif isinstance(where, _Wait):
            self._waiting[work] = where.future
            where.future.add_done_callback(lambda _: self._wake.set())
        else:
            self._running.discard(work)
            if where.error is not None:
                work.future.set_exception(where.error)
            else:
                work.future.set_result(where.result)

    # -- inside a work -------------------------------------------------------------------

    def inside(self) -> bool:
        """Whether the caller is one of this Rounds' works."""
        return self._driver is not None and getcurrent().parent is self._driver

    def _pause(self, marker):
        """Back to the driver until it resumes this work; this work's grad mode kept."""
        if not self.inside():
            raise RuntimeError("a forward or a wait through Rounds must come from a work that Rounds is running")
        grad = torch.is_grad_enabled()
        result = self._driver.switch(marker)
        torch.set_grad_enabled(grad)
        return result

    def forward(self, lm, cache, token_ids: list[int], positions: list[int], key_positions: list[int], *,
                attention_layers: list[int] | None = None, probes=None, weights: bool = True) -> ForwardResult:
        """`state.forward.forward`'s contract, from inside a work: pauses until the round's
        shared forward has run. A forward that cannot be shared (probes, the ring store) runs
        at once, on its own."""
        if not self.inside():
            raise RuntimeError("a forward through Rounds must come from a work that Rounds is running")
        if not shareable(cache, probes):
            return self.call(forward_alone, lm, cache, token_ids, positions, key_positions,
                             attention_layers=attention_layers, probes=probes, weights=weights)
        part = prepare(lm, cache, token_ids, positions, key_positions, attention_layers=attention_layers,
                       weights=weights)
        result = self._pause(_Pause(lm, part))
        if isinstance(result, Failed):
            raise result.error
        return result

    def tick(self, engine, key: Hashable, given: tuple[int, str] | None = None) -> int | None:
        """From the work of sequence `key` of `engine` (positronic/batch/engine.py): pauses until
        the engine's next round, which runs once every one of its sequences' works waits for it;
        the token the round made for `key` (`given`: (token id, ledger source) it adds instead
        of drawing one: input read), or None if its round failed (the sequence was rebuilt from
        its mirror and added nothing)."""
        if not self.inside():
            raise RuntimeError("an engine's round through Rounds must come from a work that Rounds is running")
        if key not in engine.keys():
            raise ValueError(f"sequence {key!r} is not in the engine")
        result = self._pause(_Tick(engine, key, given))
        if isinstance(result, Failed):
            raise result.error
        return result

    def call(self, function: Callable, *args, **kwargs):
        """`function(*args, **kwargs)` now, with the forwards' torch threads: a model run that
        cannot be shared (a forward with probes or over a ring store; a prompt's logprobs).
        From a work only (the ticks' one thread is put back after it)."""
        if not self.inside():
            raise RuntimeError("Rounds.call must come from a work that Rounds is running")
        with self._forward_threads():
            return function(*args, **kwargs)

    @contextlib.contextmanager
    def _forward_threads(self):
        """The driving thread's torch threads for a model run, then the ticks' one again."""
        torch.set_num_threads(self._cores)
        try:
            yield
        finally:
            torch.set_num_threads(1)

    def wait(self, future: concurrent.futures.Future):
        """This work paused until `future` is done (the others' rounds go on); its result."""
        if not future.done():
            self._pause(_Wait(future))
        return future.result()

    def offload(self, function: Callable, *args, **kwargs):
        """`function(*args, **kwargs)` in a helper thread (one torch thread), this work paused
        until it returns: a part that blocks (a file written) holds nobody up."""
        if self._helpers is None:
            self._helpers = concurrent.futures.ThreadPoolExecutor(HELPERS, thread_name_prefix="positronic-aside",
                                                                  initializer=set_threads, initargs=(1,))
        return self.wait(self._helpers.submit(function, *args, **kwargs))


class WorkLock:
    """A lock for works of one Rounds (one thread): a work that finds it held pauses
    (`wait`) until it is handed over, in the order they came. On release it goes to the first
    waiter at once, so a work that lets it go and takes it again (a session's next tick) queues
    behind a reader that was waiting. Not for several threads: outside a Rounds' works it is
    taken and let go in turn (a brain ticking alone), never waited for."""

    def __init__(self):
        self._held = False
        self._waiters: deque[concurrent.futures.Future] = deque()

    def __enter__(self) -> None:
        if not self._held:
            self._held = True
            return
        turn: concurrent.futures.Future = concurrent.futures.Future()
        self._waiters.append(turn)
        wait(turn)  # held from here: handed over by __exit__

    def __exit__(self, *exc) -> None:
        if self._waiters:
            self._waiters.popleft().set_result(None)
        else:
            self._held = False

    def locked(self) -> bool:
        return self._held


def _meeting() -> Rounds | None:
    """The Rounds this work runs in, if the caller is one of its works."""
    meeting = MEETING.get()
    return meeting if isinstance(meeting, Rounds) and meeting.inside() else None


def wait(future: concurrent.futures.Future):
    """`Rounds.wait` in a work (the others' rounds go on); else the future's result, blocking."""
    meeting = _meeting()
    return future.result() if meeting is None else meeting.wait(future)


def tick(engine, key: Hashable, given: tuple[int, str] | None = None) -> int | None:
    """`Rounds.tick` in a work; else the engine's round now (its only sequence's caller: a
    round ticks every sequence in it)."""
    meeting = _meeting()
    if meeting is not None:
        return meeting.tick(engine, key, given)
    if engine.keys() != [key]:
        raise RuntimeError("outside a Rounds work an engine's round is stepped by the caller of its only sequence")
    return engine.step({key: given} if given is not None else None).get(key)


def offload(function: Callable, *args, **kwargs):
    """`Rounds.offload` in a work (the others' rounds go on meanwhile); else just the call."""
    meeting = _meeting()
    return function(*args, **kwargs) if meeting is None else meeting.offload(function, *args, **kwargs)


class Failed:
    """The error a sequence's forward raised, in place of its result."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


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
