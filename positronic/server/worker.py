"""The model worker: the one thread that runs every job touching a brain, and the forwards of them all.

    worker = ModelWorker(on_forward=metrics.record_batch, threads=2)
    result = await worker.run(conversation.step, {}, owner=conversation)   # one job, awaited on the event loop
    async for item in worker.stream(work, owner=conversation): ...         # one job that posts as it goes

Three kinds of thread meet here. The event loop (the requests' coroutines) submits a job with
`Rounds.submit` and awaits its future; the forward thread ("positronic-forward") serves the one
`Rounds` (positronic/batch/rounds.py), where each job is a greenlet that pauses at its model
forwards, and the paused forwards of every job run as one; what a job would block on (a
checkpoint's files) goes to a helper thread (`batch.offload`) while the others' rounds go on.
A job hands items back to the event loop with `loop.call_soon_threadsafe` (`stream`). A
session's own jobs run one after another (`owner`, `settled`); other sessions' do not wait.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import torch

from ..batch import Rounds
from ..batch.engine import Engine
from ..batch.seats import Seats
from ..batch.threads import set_threads

if TYPE_CHECKING:
    from .conversation import Conversation

_ENDED = object()  # ModelWorker.stream: the job returned (or raised)


class ModelWorker:
    """Runs every job that touches a brain, as soon as it is submitted, as a work of one
    `Rounds` (positronic.batch) in a thread of its own ("positronic-forward"): the jobs of
    different sessions run side by side, each a greenlet that pauses at its model forwards,
    and the paused forwards run as one (continuous batching: a session joins with its next
    job and leaves when it has none). A job's blocking part (a checkpoint written) goes to a
    helper thread meanwhile (`batch.offload`). A session's own jobs never overlap: its
    requests hold its lock and await each job. A job runs to its end even if its request is
    cancelled meanwhile (a brain step is never cut in half), and the next request of its
    session waits for it (`settled`) before it looks at the brain; requests of other sessions
    do not. The forwards run with torch's `threads`, the jobs' own ops with one
    (positronic/batch/threads.py says why)."""

    def __init__(self, *, on_forward: Callable[[int], None] = lambda sequences: None, threads: int | None = None,
                 engine_slots: int = 0, engine_smartkv: bool = False, engine_compiled: bool = False):
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a whole number of at least 1 (or None: torch's), got {threads!r}")
        # Core v4 (positronic/batch/engine.py): a reply's ticks run as rounds of one engine per
        # budget and scored layers, `engine_slots` sequences each (0: none; every tick a brain's own)
        if isinstance(engine_slots, bool) or not isinstance(engine_slots, int) or engine_slots < 0:
            raise ValueError(f"engine_slots must be a whole number of at least 0 (0: no engine), got {engine_slots!r}")
        self.engine_slots = engine_slots
        # SmartKV sessions (lanes apart) in engines too: off by default. On a 2-core CPU with SmolLM2
        # they made 0.68x the tokens/s of ticking alone (the forward bounds a round there, and each
        # request's join and hand-back copy the recall index, then ~94 MB, now up to 188 MB: bench/results/server.md)
        self.engine_smartkv = engine_smartkv
        # each engine's forward one compiled graph per bucket (positronic/models/compiled.py)
        self.seats = Seats(slots=engine_slots, smartkv=engine_smartkv, compiled=engine_compiled) if engine_slots else None
        self.meeting = Rounds(on_forward=on_forward)
        self.threads = threads or torch.get_num_threads()  # torch's, for the forward thread
        serving = threading.Event()
        self._forwards = threading.Thread(target=self._run_forwards, args=(serving,), name="positronic-forward",
                                          daemon=True)
        self._forwards.start()
        serving.wait()  # a job is never submitted before the forward thread serves
        if not self._forwards.is_alive():
            raise RuntimeError("the server's forward thread did not start")
        self._lock = threading.Lock()
        self._owned: dict[int, concurrent.futures.Future] = {}  # a conversation's (id) last job
        self.ticking: dict[int, asyncio.Future] = {}  # conversation (id) -> its request's turn in progress (`stream`)
        self._closed = False

    def engine_for(self, brain) -> Engine | None:
        """In a job: the engine `brain`'s reply ticks in (seats.py: one of its kind with a free
        slot and room for its budget, made the first time one is needed), or None where it
        cannot (no engines, settings Core v4 does not run yet, a policy that stops at capacity,
        SmartKV without engine_smartkv, every slot in use): it ticks on its own then."""
        return None if self.seats is None else self.seats.engine_for(brain)

    def warm(self, brain) -> int:
        """In a job, before serving: the engine a brain like `brain` would tick in, made now,
        with every batch size's compiled graph (`serve --compile`). Returns the graphs made."""
        engine = self.engine_for(brain)
        # with the forwards' torch threads, as the rounds run: a graph is compiled for a thread
        # count (dynamo guards it), and one made with the jobs' one thread would be made again
        return 0 if engine is None else self.meeting.call(engine.warm, brain.config)

    @property
    def engine_rounds(self) -> int:
        """Rounds the engines have run (each one token for every sequence in it)."""
        return 0 if self.seats is None else self.seats.rounds

    async def run(self, fn: Callable, *args, owner: Conversation | None = None):
        """Run `fn(*args)` as a job; `owner`: the conversation it touches, whose jobs run one
        after another (a save never overlaps a step a cancelled request left running). A job
        runs in the forward thread between the others' forwards: what it would block on
        (a file, a lock of another thread) goes to `batch.offload`, or every session waits."""
        if owner is not None:
            await self.settled(owner)
        with self._lock:
            if self._closed:
                raise RuntimeError("the model worker is closed")
            future = self.meeting.submit(functools.partial(fn, *args))
            if owner is not None:
                self._owned[id(owner)] = future
        future.add_done_callback(self._ended)
        return await asyncio.wrap_future(future)

    async def stream(self, work: Callable[[Callable[[object], None]], None], *,
                     owner: Conversation | None = None) -> AsyncIterator:
        """Run `work(post)` as one job (`run`), yielding here each item it `post`s, as it posts
        it, until it returns; what it raises is raised here after the items posted before.
        A job that ticks a sequence many times (a request's whole reply) stays in the rounds
        between its ticks: each round goes as soon as the sequences' ticks are in, instead of
        waiting for this event loop to start the next job (a job per token).
        Leaving the loop early does not stop the job: `work` watches what should stop it."""
        loop = asyncio.get_running_loop()
        posted: asyncio.Queue = asyncio.Queue()

        def post(item) -> None:
            try:
                loop.call_soon_threadsafe(posted.put_nowait, (item, None))
            except RuntimeError:  # the loop closed (the server stopped): nobody reads it
                pass

        def ended(job: asyncio.Future) -> None:
            error = job.exception() if not job.cancelled() else asyncio.CancelledError()
            posted.put_nowait((_ENDED, error))

        job = asyncio.ensure_future(self.run(work, post, owner=owner))
        if owner is not None:  # its session's state is read between two of its ticks (Conversation.between_ticks)
            self.ticking[id(owner)] = job

            def over(_) -> None:  # this turn's entry only: the session's next request may have begun its own
                if self.ticking.get(id(owner)) is job:
                    del self.ticking[id(owner)]

            job.add_done_callback(over)
        job.add_done_callback(ended)  # after every post: the job posted them before it returned
        while True:
            item, error = await posted.get()
            if item is _ENDED:
                if error is not None:
                    raise error
                return
            yield item

    async def settled(self, owner: Conversation) -> None:
        """Wait until `owner`'s last job has run (a tick its cancelled request left running
        ends, and adds its token to the reply, before anyone reads the reply)."""
        while (earlier := self._owned.get(id(owner))) is not None and not earlier.done():
            await asyncio.sleep(0.002)

    def _run_forwards(self, serving: threading.Event) -> None:
        try:
            set_threads(self.threads)
            self.meeting.serve(starting=serving.set)
        finally:
            serving.set()  # failed before serving: __init__ must not wait for ever

    def _ended(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            for key in [key for key, job in self._owned.items() if job is future]:
                del self._owned[key]

    def close(self) -> None:
        """Refuse new jobs and wait for those submitted (the forward thread ends once they are done)."""
        with self._lock:
            self._closed = True
        self.meeting.stop()
        self._forwards.join()
