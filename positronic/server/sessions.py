"""The server's conversations: one brain per session, their ticks batched into shared forwards.

    worker = ModelWorker()                      # every job that touches a brain runs here
    pool = SessionPool(lm, worker, directory, max_sessions=16)
    conversation = await pool.acquire("alice")  # in memory, resumed from disk, or new (brain None)
    ... Turn(conversation, worker, reply).pieces() ...
    pool.release(conversation)

A session is a Conversation: its Brain and the input it has still to read. A request holds its
conversation (an asyncio lock) from its first token read to its last token generated, so two
requests of one session never interleave; requests of different sessions run side by side, each
request's turn one job (a greenlet of the server's forward thread), and their ticks' model
forwards are run as one (positronic.batch: each sequence over its own cache, so states never
mix: a step is a call on one brain). A session's later request appends its new turn to the live brain; nothing is prefilled
again.

The pool keeps at most `max_sessions` conversations in memory (a request without a session
gets a throwaway conversation that counts too). To make room, and when a session has been
idle `idle_save_s`, the least recently used idle one is checkpointed with
positronic/brain/session.py into `directory/ID/` and freed; its next request resumes it from there,
token for token as if it had stayed. `close()` checkpoints every session (graceful shutdown).
A session in memory holds its directory (brain/session.py Claim) until it is freed: run.py or
another server is refused it meanwhile, and a session one of them holds is refused here
(SessionInUse), before any slot is freed for it.
A checkpoint that cannot be written is logged (session and file) and counted; the session stays
in memory (tried again when room is needed, and at close, which returns the sessions it lost),
and a request that needed its slot gets SaveFailed, not an endless PoolFull.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from pathlib import Path

import torch

from ..brain import session as sessions
from ..batch import Rounds, WorkLock, offload
from ..batch.threads import set_threads
from ..brain.loop import Brain, BrainConfig, TickRecord
from .answers import Answers
from .history import History
from .logprobs import TokenLogprob, of_logits
from .text import Reply
from ..state.manager import StateBrokenError
from ..state.readonly import MirrorView

log = logging.getLogger("positronic.server.app")

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
HOLDER = "positronic serve"  # how a session's lock file names the server holding it
TRANSCRIPT_SOURCES = ("prompt", "user", "generated")  # what was said; repairs and insertions are the brain's own
MAX_FAILED_TICKS = 3  # ticks in a row that fail (rebuilt, nothing added) before a request gives up
_ENDED = object()  # ModelWorker.stream: the job returned (or raised)


class PoolFull(Exception):
    """Every conversation slot is held by a request: nothing can be freed for another one."""


class SaveFailed(Exception):
    """No slot can be freed because the idle sessions that could make room cannot be
    checkpointed (the session directory is unwritable, the disk full): not the client's doing."""


class SessionUnusable(Exception):
    """A checkpointed session that cannot be resumed (damaged, or saved with another model)."""


class SessionInUse(Exception):
    """Another process (run.py, another server) holds the session's directory: `holder` names it."""

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder


class ClientGone(Exception):
    """The client went away: the request's generation stops."""


class ServerStopping(Exception):
    """The server is shutting down: the request's generation stops at a token boundary."""


def evicts_nothing(config: BrainConfig) -> bool:
    """Whether a brain under `config` never makes room (policy none with at_capacity stop): its
    live length only grows, so the server admits no input it has no room for."""
    return config.policy == "none" and config.at_capacity == "stop"


def check_session_id(value: str) -> str:
    """`value` if it is a usable session id (1-64 of A-Z a-z 0-9 _ -: it names a directory),
    else ValueError saying so."""
    if not SESSION_ID.fullmatch(value):
        raise ValueError(f"session id {value[:80]!r} must be 1 to 64 characters from A-Z a-z 0-9 _ -")
    return value


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

    def __init__(self, *, on_forward: Callable[[int], None] = lambda sequences: None, threads: int | None = None):
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a whole number of at least 1 (or None: torch's), got {threads!r}")
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


class Conversation:
    """One session's brain (None until its first request) and the forced tokens it still has
    to read (a reply's closing, a completion's text); typed turns wait in the brain itself
    (Brain.say). The methods that touch the brain run on the model worker; `on_tick` sees
    every tick with its duration (the server's metrics)."""

    def __init__(self, session_id: str | None, on_tick: Callable[[TickRecord, float], None] = lambda r, s: None):
        self.id = session_id
        self.brain: Brain | None = None
        self.forced: deque[int] = deque()
        self.on_tick = on_tick
        self.lock = asyncio.Lock()
        self.users = 0  # requests holding or waiting for the lock (plus an eviction in progress)
        self.last_used = time.monotonic()
        self.dirty = False  # changed since it was resumed or saved
        self.evicted = False  # checkpointed and freed: a request that waited for it starts again
        self.broken = False  # its state cannot be trusted: dropped, never saved
        self.cut = False  # the shutdown cancelled a reply of its before the client got it: not saved at close
        self.evicting = False  # held by an eviction (a checkpoint being written), not by a request
        self.answers = Answers()  # the answer to its last keyed request (answers.py), checkpointed with it
        self.history = History(None)  # a chat session's messages (history.py), checkpointed with it
        self.stepping = WorkLock()  # held through each tick: a reader in another job waits for its end
        self.claim: sessions.Claim | None = None  # its directory, held while it is in the pool (SessionPool)

    # -- on the model worker --------------------------------------------------------------

    def start(self, lm, prompt_ids: list[int], config: BrainConfig) -> None:
        """Prefill a fresh brain with the prompt (at most the budget: checked by the caller)."""
        self.brain = Brain.start(lm, prompt_ids, config)
        self.dirty = True

    @property
    def reading(self) -> bool:
        """Input still to be added before a reply can be generated."""
        return bool(self.forced) or bool(self.brain is not None and self.brain.pending_input)

    def queue(self, forced: list[int] = (), turns: list[str] = ()) -> None:
        """Queue `forced` ids, then each user turn (Brain.say: TurnRefused if one is too long;
        check them first, as a refused one leaves the earlier ones queued)."""
        self.forced.extend(forced)
        for text in turns:
            self.brain.say(text)

    def read_one(self) -> TickRecord | None:
        """Add the next queued input token (forced ones first: they come before the turns);
        None, and no tick, when there is none."""
        if not self.reading:
            return None
        return self._tick(self.forced[0] if self.forced else None, forced=bool(self.forced))

    def settle(self) -> None:
        """Read every queued input token (before a new turn is queued, and before a save)."""
        while self.reading:
            self.read_one()

    def step(self, sampling: dict) -> TickRecord:
        """Generate one token, with `sampling` (temperature, top_p) in place of the session's
        own settings for this tick only: the session keeps (and saves) its own."""
        if not sampling:
            return self._tick(None)
        own = self.brain.config
        self.brain.config = dataclasses.replace(own, **sampling)
        try:
            return self._tick(None)
        finally:
            self.brain.config = own

    def _tick(self, force: int | None, *, forced: bool = False) -> TickRecord:
        config = self.brain.config
        if evicts_nothing(config) and self.brain.state.rows_per_layer >= config.budget:
            # the server admits no more than fits (BrainServer.check_room): never a tick past the budget
            raise RuntimeError(f"the session is full ({config.budget} rows) and its policy evicts nothing")
        start = time.perf_counter()
        self.dirty = True
        try:
            with self.stepping:
                record = self.brain.step(force)
        except StateBrokenError:
            self.broken = True
            raise
        if self.brain.state.broken:
            self.broken = True
            raise StateBrokenError(f"the session's state is broken: {self.brain.state.broken}")
        if forced and not record.rebuilt:
            self.forced.popleft()
        self.on_tick(record, time.perf_counter() - start)
        return record

    def save(self, directory: Path, model_name: str) -> None:
        """Checkpoint into `directory` (its input read first: only typed turns are saved pending),
        with its answers in the same atomic write."""
        self.settle()
        # writing makes no forward: in a helper thread, the others' rounds need not wait (~0.1 s)
        offload(sessions.save, directory, self.brain, model_name,
                note={**self.answers.note(), "history": self.history.note()})
        self.dirty = False

    def replied(self, text: str, *, again: bool) -> None:
        """The reply into the chat history; a change is a change of the session (a retry that
        replays its answer may still mend the record, and the next checkpoint must hold that)."""
        if self.history.replied(text, again=again):
            self.dirty = True

    def last_token(self) -> int:
        return self.brain.state.live_token_ids()[-1]

    def between_ticks(self, fn: Callable[[], object]):
        """On the model worker, in a job of its own while the session's request ticks in
        another: `fn()` between two of its ticks (the tick in progress ends first, and the
        next one waits for `fn`)."""
        with self.stepping:
            return fn()

    def describe(self) -> dict:
        """The session's state for clients: counts, and its text (transcript and live)."""
        return describe(self.brain.state.mirror, self.brain.tick, self.brain.config.budget)


def describe(mirror: MirrorView, tick: int, budget: int) -> dict:
    """A session's mirror in words: what was said (the ledger's prompt, user and generated
    tokens, in order), what the brain holds now (the live rows), and the counts.
    `transcript_tokens` counts what was said: the sum of the session's requests' usage
    (prompt_tokens + completion_tokens), whatever the policy culled, repaired or recalled."""
    ledger = mirror.ledger  # a MirrorView's: columns read at list speed
    said = [text for source, text in zip(ledger.column("source"), ledger.column("text")) if source in TRANSCRIPT_SOURCES]
    rows = len(mirror) if mirror.layers is None else len(mirror.layers)  # per layer: what the budget bounds
    return {"tick": tick, "budget": budget, "live_length": rows, "ledger_tokens": len(ledger),
            "transcript_tokens": len(said),
            "culled": ledger.count("culled"), "replaced": ledger.count("replaced"),
            "transcript": "".join(said),
            "live_text": "".join(mirror.live_texts())}


@dataclasses.dataclass
class Prepared:
    """What a request's input did to its session: the tokens it added, their log-probabilities
    where echo asked and they were prefilled, how many of them the policy pruned at once (a
    fresh prompt past the budget), and how echoed log-probabilities were computed."""

    tokens: int
    echoed: list[TokenLogprob] = dataclasses.field(default_factory=list)
    pruned: int = 0
    how: str = "exact"


class Turn:
    """One request's part of a conversation: the input queued for it read, then its reply
    generated, a tick at a time, in one worker job (`_run`) whose ticks meet the other
    sessions' in shared forwards. `pieces()` yields the reply's text as it becomes sendable;
    ClientGone when `gone()` says the client left (asked after every tick; the job stops before
    its next one), ServerStopping when `stop()` says the server is shutting down (the job stops
    at the next token boundary, and every token it made is yielded first). `reply`: a reply begun earlier (a retried request, answers.py):
    its text so far comes first, then generation goes on (nothing, if it is finished).
    `logprobs` (the alternatives to list per token; None: none asked) fills `entries` with each
    generated token's log-probability (logprobs.py); with `echo`, `read` gets the tokens read
    for it (a running session's prompt, teacher-forced through its cache) the same way."""

    def __init__(self, conversation: Conversation, worker: ModelWorker, lm, *, max_tokens: int,
                 stops: list[str] = (), sampling: dict | None = None, ignore_eos: bool = False,
                 stop_ids: Collection[int] = (), reply: Reply | None = None, retried: bool = False,
                 on_token: Callable[[bool, float], None] = lambda first, seconds: None, started: float | None = None,
                 logprobs: int | None = None, echo: bool = False, chat: bool = False):
        self.conversation, self.worker, self.lm = conversation, worker, lm
        self.max_tokens, self.stops, self.sampling = max_tokens, stops, sampling or {}
        self.ignore_eos, self.stop_ids = ignore_eos, stop_ids
        self.reply = reply
        self.earlier_tokens = reply.tokens if reply is not None else 0  # generated before this request
        self.retried = retried  # it takes up an earlier request's answer (an Idempotency-Key sent again)
        # each generated token: whether it is the request's first, and the seconds since the request
        # began (the first) or since the token before (the metrics' time to first token, inter-token latency)
        self.on_token = on_token
        self.started = time.perf_counter() if started is None else started  # perf_counter() when the request came
        self.logprobs, self.echo, self.chat = logprobs, echo, chat
        self.read: list[TokenLogprob] = []  # the input tokens read for this request (with echo)
        self.entries: list[TokenLogprob] = []  # the reply's tokens (with logprobs)
        self.ready = 0  # of `entries`, those of the tokens `pieces()` has yielded so far (the job runs ahead)
        self.prepared = Prepared(0)  # what its input did (BrainServer.begin_turn)

    @property
    def generated(self) -> int:
        """Tokens this request generated (a retry's earlier part not counted)."""
        return (self.reply.tokens if self.reply is not None else 0) - self.earlier_tokens

    async def pieces(self, gone: Callable[[], Awaitable[bool]] | None = None,
                     stop: Callable[[], bool] | None = None) -> AsyncIterator[str]:
        if self.reply is not None and self.reply.text:
            yield self.reply.text
        if self.reply is not None and self.reply.done:
            return
        stopping = stop or (lambda: False)
        if gone is not None and await gone():
            raise ClientGone()
        if stopping():
            raise ServerStopping()
        halt = threading.Event()  # set when this request stops listening: the job stops before its next tick
        last = None
        try:
            async for generated, ready in self.worker.stream(functools.partial(self._run, halt, stopping),
                                                             owner=self.conversation):
                if generated:  # a token of the reply (not one of the input read)
                    now = time.perf_counter()
                    self.on_token(last is None, now - (self.started if last is None else last))
                    last = now
                self.ready = ready
                if generated and generated[0]:
                    yield generated[0]
                if gone is not None and await gone():
                    raise ClientGone()
        finally:
            halt.set()
        if self.reply is None or not self.reply.done:  # the job stopped at a token boundary, every token
            raise ServerStopping()                         # it made yielded

    def _run(self, halt: threading.Event, stopping: Callable[[], bool], post: Callable[[object], None]) -> None:
        """On the model worker, one job for the whole request: the input still to read, then the
        reply, a tick at a time, until the reply is done or `halt` (the request stopped listening)
        or `stopping()` (the server is shutting down) is found before a tick. Posts, after each
        tick, ((piece,) for a generated token or None for one read, entries ready)."""
        conversation = self.conversation
        if self.reply is None:
            while conversation.reading:
                if halt.is_set() or stopping():
                    return
                self._read_one()
                post((None, len(self.entries)))
            self.reply = Reply(self.lm, conversation.last_token(), self.max_tokens, self.stops,
                               ignore_eos=self.ignore_eos, stop_ids=self.stop_ids)
        failed = 0
        while not self.reply.done:
            if halt.is_set() or stopping():
                return
            record, piece = self._next_token()
            if record.rebuilt:  # the tick failed and added nothing (the state was rebuilt)
                failed += 1
                if failed >= MAX_FAILED_TICKS:
                    raise RuntimeError(f"{failed} ticks in a row failed: {record.error}")
                continue
            failed = 0
            post(((piece,), len(self.entries)))

    def _next_token(self) -> tuple[TickRecord, str]:
        """On the model worker: one tick, and its token taken into the reply in the same job, so
        that a token the brain took is always the reply's (a request cancelled while the job
        runs, by a client leaving, loses the text's piece but not the token: a retry sends it)."""
        logits = self.conversation.brain.state.next_logits if self.logprobs is not None else None
        record = self.conversation.step(self.sampling)
        if record.rebuilt:
            return record, ""
        kept = len(self.reply.ids)
        piece = self.reply.add(record.token_id, stopped=record.stopped)
        if logits is not None and len(self.reply.ids) > kept:  # a token of the text (not the one ending it)
            self.entries.append(self._entry(logits, record.token_id))
        return record, piece

    def _read_one(self) -> None:
        """On the model worker: the next input token read (Conversation.read_one), with its
        log-probability under the context before it when `echo` asks for it."""
        conversation = self.conversation
        logits = conversation.brain.state.next_logits if self.echo else None
        record = conversation.read_one()
        if logits is not None and record is not None and not record.rebuilt:
            self.read.append(self._entry(logits, record.token_id))

    def _entry(self, logits, token_id: int) -> TokenLogprob:
        if not bool(torch.isfinite(logits).all()):  # the tick rebuilt the cache and drew from new logits
            return TokenLogprob(token_id, None)
        return of_logits(logits, token_id, self.logprobs or 0)


class SessionPool:
    """The conversations in memory, at most `max_sessions` of them; the rest checkpointed
    under `directory`, one subdirectory per session id."""

    def __init__(self, lm, worker: ModelWorker, directory: Path, *, max_sessions: int, idle_save_s: float = 0.0,
                 on_tick: Callable[[TickRecord, float], None] = lambda r, s: None):
        self.lm, self.worker, self.directory = lm, worker, Path(directory)
        self.max_sessions, self.idle_save_s, self.on_tick = max_sessions, idle_save_s, on_tick
        self._loaded: dict[str, Conversation] = {}
        self._throwaway = 0  # throwaway conversations in use
        self._admit = asyncio.Lock()  # one admission (eviction, resume) at a time
        self.saved = 0  # checkpoints written
        self.resumed = 0  # sessions brought back from disk
        self.freed = 0  # sessions checkpointed and freed (room, idleness)
        self.save_failures = 0  # checkpoints that could not be written
        self.unsaved: dict[str, str] = {}  # id -> why its last checkpoint failed (still in memory)

    @property
    def loaded(self) -> dict[str, Conversation]:
        return self._loaded

    @property
    def in_use(self) -> int:
        """Slots taken: sessions in memory plus throwaway conversations."""
        return len(self._loaded) + self._throwaway

    def path(self, session_id: str) -> Path:
        return self.directory / session_id

    async def acquire(self, session_id: str | None) -> Conversation:
        """The conversation of `session_id` (None: a new throwaway one), held for this request
        (waits while an earlier request of the session holds it). PoolFull when no slot can be
        freed; SessionUnusable when its checkpoint cannot be resumed; SessionInUse when another
        process holds its directory (nothing changed: no other session freed for it)."""
        if session_id is None:
            async with self._admit:
                await self._make_room()
                self._throwaway += 1
            conversation = Conversation(None, self.on_tick)
            conversation.users = 1
            await conversation.lock.acquire()
            return conversation
        while True:
            conversation = self._loaded.get(session_id) or await self._admit_session(session_id)
            conversation.users += 1
            try:
                await conversation.lock.acquire()
            except BaseException:
                conversation.users -= 1
                raise
            if not conversation.evicted:
                try:  # a step that a cancelled request left running finishes first: this session's
                    await self.worker.settled(conversation)  # own, not every session's job in flight
                except BaseException:
                    self.release(conversation)
                    raise
                return conversation
            conversation.lock.release()  # freed while this request waited: load it again
            conversation.users -= 1

    def release(self, conversation: Conversation) -> None:
        """The request is done with it. A broken conversation is dropped (never saved: a
        session's next request resumes from its last checkpoint, if it has one)."""
        conversation.last_used = time.monotonic()
        conversation.lock.release()
        conversation.users -= 1
        if conversation.id is None:
            self._throwaway -= 1
        elif conversation.broken and self._loaded.get(conversation.id) is conversation:
            del self._loaded[conversation.id]
            self._let_go(conversation)
            log.warning("session %s dropped: its state is broken", conversation.id)

    async def _admit_session(self, session_id: str) -> Conversation:
        async with self._admit:
            if (conversation := self._loaded.get(session_id)) is not None:
                return conversation  # admitted while this request waited
            conversation = Conversation(session_id, self.on_tick)
            path = self.path(session_id)
            self._claim(conversation)  # first: a session another process holds costs no other its slot
            try:
                await self._make_room()
                if (path / sessions.MIRROR_FILE).exists():
                    try:
                        conversation.brain, note = await self.worker.run(self._resume, path, owner=conversation)
                        conversation.answers = Answers.from_note(note, self.lm.vocab_size)
                        conversation.history = History.from_note((note or {}).get("history"))
                    except (sessions.SessionError, ValueError) as exc:
                        raise SessionUnusable(f"session {session_id} cannot be resumed: {exc}") from None
                    self.resumed += 1
            except BaseException:
                self._let_go(conversation)
                raise
            self._loaded[session_id] = conversation
            return conversation

    def _claim(self, conversation: Conversation) -> None:
        """Hold the conversation's directory while it is in the pool (brain/session.py Claim):
        run.py or another server on the session is refused meanwhile, and this pool is refused
        a session they hold (SessionInUse). A directory that cannot be made (the storage is
        unwritable) leaves it unclaimed: it is served from memory, and claimed at its first
        checkpoint, whose failure is said as any failed checkpoint is."""
        try:
            conversation.claim = sessions.Claim(self.path(conversation.id), HOLDER)
        except sessions.SessionLocked as exc:
            raise SessionInUse(f"session {conversation.id} is in use by {exc.holder}: one process at a time "
                               "holds a session; try again once it has let the session go", exc.holder) from None
        except sessions.SessionError as exc:  # its lock file is a link or not a file
            raise SessionUnusable(f"session {conversation.id} cannot be used: {exc}") from None
        except OSError:
            conversation.claim = None

    @staticmethod
    def _let_go(conversation: Conversation) -> None:
        if conversation.claim is not None:
            conversation.claim.release()
            conversation.claim = None

    def _resume(self, path: Path) -> tuple[Brain, dict | None]:
        """On the model worker: a checkpoint's files read in a helper thread (the others' rounds
        go on), then its brain rebuilt here."""
        return sessions.rebuild(self.lm, offload(sessions.read, self.lm, path))

    async def _make_room(self) -> None:
        """Free slots until one is free: checkpoint and free the least recently used idle
        conversations. PoolFull when every one is in use."""
        skipped: set[str] = set()
        while self.in_use >= self.max_sessions:
            idle = [c for c in self._loaded.values() if c.users == 0 and c.id not in skipped]
            if not idle:
                if skipped:  # slots idle sessions hold, which cannot be checkpointed: no retry helps soon
                    failed = "; ".join(f"session {sid}: {self.unsaved.get(sid, 'not saved')}" for sid in sorted(skipped))
                    raise SaveFailed(f"no session slot can be freed: the idle sessions holding them could not be "
                                     f"checkpointed to the server's session directory ({failed})")
                raise PoolFull(f"all {self.max_sessions} sessions are in use (--max-sessions); try again later")
            victim = min(idle, key=lambda c: c.last_used)
            if not await self._evict(victim):
                skipped.add(victim.id)

    async def _evict(self, conversation: Conversation) -> bool:
        """Checkpoint `conversation` (if it changed) and free it, once no request holds it.
        False, and it stays, if the checkpoint cannot be written."""
        conversation.users += 1
        await conversation.lock.acquire()
        conversation.evicting = True
        try:
            if conversation.evicted or self._loaded.get(conversation.id) is not conversation:
                return True
            if not await self.checkpoint(conversation):
                return False
            conversation.evicted = True
            del self._loaded[conversation.id]
            self._let_go(conversation)
            self.freed += 1
            return True
        finally:
            conversation.evicting = False
            conversation.lock.release()
            conversation.users -= 1

    async def checkpoint(self, conversation: Conversation) -> bool:
        """Checkpoint `conversation` if it changed since its last one (a broken one never is);
        False, said in the log and counted, if it cannot be written: it stays in memory."""
        if conversation.brain is None or not conversation.dirty or conversation.broken:
            return True
        path = self.path(conversation.id)
        try:
            if conversation.claim is None:  # its directory could not be made when it came in
                conversation.claim = sessions.Claim(path, HOLDER)
            await self.worker.run(conversation.save, path, self.lm.name, owner=conversation)
        except Exception as exc:  # whatever it is, the session stays in memory, and it is said
            self.save_failures += 1
            self.unsaved[conversation.id] = f"{type(exc).__name__}: {exc}"
            log.error("session %s could not be checkpointed to %s: %s: %s", conversation.id,
                      path / sessions.MIRROR_FILE, type(exc).__name__, exc)
            return False
        self.saved += 1
        self.unsaved.pop(conversation.id, None)
        return True

    async def sweep(self) -> int:
        """Checkpoint and free the sessions idle for `idle_save_s` (0: none); how many."""
        if not self.idle_save_s:
            return 0
        now, freed = time.monotonic(), 0
        for conversation in list(self._loaded.values()):
            if conversation.users == 0 and now - conversation.last_used >= self.idle_save_s:
                async with self._admit:
                    if conversation.users == 0:
                        freed += await self._evict(conversation)
        return freed

    async def close(self, cut: set[str] = frozenset()) -> tuple[int, dict[str, str]]:
        """Checkpoint every session in memory (each once its request is done) and free it: how
        many checkpoints were written, and the sessions that could not be (id -> why), lost
        when the process ends. The sessions in `cut` are not checkpointed: a reply of theirs
        was cut before its client got it, and a checkpoint keeps only what clients received
        (their last checkpoint, if any, stays)."""
        before, lost = self.saved, {}
        async with self._admit:
            for conversation in list(self._loaded.values()):
                if conversation.id in cut:
                    why = "the shutdown cut a reply before its client got it all"
                    log.error("session %s is not checkpointed: %s (its last checkpoint, if any, stays)",
                              conversation.id, why)
                    lost[conversation.id] = why
                    continue
                await self._evict(conversation)
            for conversation in self._loaded.values():  # cut or unsaved: nothing writes them any more
                self._let_go(conversation)
        lost.update({sid: self.unsaved.get(sid, "not saved") for sid in self._loaded if sid not in lost})
        return self.saved - before, lost

    async def describe(self, session_id: str) -> dict | None:
        """describe() of a session in memory or on disk; None if there is no such session."""
        conversation = self._loaded.get(session_id)
        if conversation is not None and conversation.brain is not None:
            if id(conversation) in self.worker.ticking:  # a request's turn: between two of its ticks
                return await self.worker.run(conversation.between_ticks, conversation.describe)
            return await self.worker.run(conversation.describe, owner=conversation)  # after its last job
        path = self.path(session_id)
        if not (path / sessions.MIRROR_FILE).exists():
            return None

        def load() -> dict:
            saved, meta = sessions.load(path)
            return describe(MirrorView(saved), meta["tick"], meta["config"]["budget"])

        try:
            return await self.worker.run(offload, load)  # files read: in a helper thread, the rounds go on
        except sessions.SessionError as exc:
            raise SessionUnusable(f"session {session_id} cannot be read: {exc}") from None
