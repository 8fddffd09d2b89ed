"""The server (`BrainServer`): its parts put together, its lifetime, and each generation
request's course from its route to its answer; and the server's limits (`ServerSettings`).
The routes that call it are in positronic/server/app.py.

A generation request (`generate`) goes, on the event loop:

    rules.py     checked: the model, n, max_tokens, the session id, sampling, logprobs
    admission    (here) a place among --max-pending (429 past it)
    pool.py      its conversation held (its lock: one request of a session at a time)
    prepare.py   its input made token ids (text thread) and prefilled or queued (model worker)
    replies.py   its Turn (turn.py) run as one job of the model worker (worker.py), the tokens
                 streamed or gathered, the session checkpointed, the answer sent

The threads: the event loop runs every coroutine here; the text thread (`off_loop`) tokenizes;
the forward thread (worker.py) runs every job that touches a brain, the model forwards of
all of them shared; helper threads write checkpoints (`batch.offload`). docs/batching.md ("In
the server") draws one request's way through them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..brain.loop import BrainConfig
from . import answers, replies, rules
from .choices import merge_events, merge_whole
from .conversation import Conversation
from .metrics import Metrics
from .pool import PoolFull, SaveFailed, SessionInUse, SessionPool, SessionUnusable
from .prepare import Preparer
from .replies import Begun
from .schemas import APIError, GenerationBody, StreamOptions, stops_of
from .streaming import ChatWriter, CompletionWriter, EventStream, as_events
from .tools import Tools
from ..brain.chat import ChatFormat
from .turn import Turn
from .worker import ModelWorker

log = logging.getLogger("positronic.server.app")

CLOSE_WAIT_S = 5.0  # how long close() waits for the answers in flight to be sent


@dataclass
class ServerSettings:
    """The server's limits and where it keeps sessions (the brain's settings are a BrainConfig)."""

    session_dir: Path
    max_sessions: int = 16  # conversations in memory, throwaway ones included
    idle_save_s: float = 300.0  # checkpoint and free a session idle this long (0: never)
    max_pending: int = 64  # generation requests in the server at once
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096  # the most one request may generate
    default_max_tokens: int = 256
    sweep_every_s: float = 5.0  # how often idle sessions are looked for
    checkpoint_each_request: bool = True  # write a session through to disk before each answer's last byte
    history_edits: str = "refuse"  # a chat whose earlier messages differ from its session's: refuse (409) | rebuild
    threads: int | None = None  # torch's threads in the forward thread (None: this thread's when the server is made)
    engine_slots: int = 16  # sequences per Core v4 engine whose rounds run replies' ticks (0: none; worker.py)
    engine_smartkv: bool = False  # SmartKV sessions tick in engine rounds too (worker.py: slower on a CPU)
    engine_compiled: bool = False  # the engines' rounds as compiled graphs (positronic/models/compiled.py)
    # the model ids requests may name (vLLM's --served-model-name): () the model's own name, as `-m` gave it
    served_model_names: tuple[str, ...] = ()


class BrainServer:
    """The endpoints' work: requests checked, conversations held, turns run, answers written.
    One per app; `start()`/`close()` in the app's lifespan."""

    def __init__(self, lm, config: BrainConfig, settings: ServerSettings):
        self.lm, self.config, self.settings = lm, config, settings
        self.names = rules.served_names(lm, settings)
        self.created = int(time.time())
        self.metrics = Metrics(model_name=self.names[0])
        self.format = ChatFormat(lm)
        # Tokenizing runs here, off the event loop (a 1 MB prompt takes about a second, and the
        # loop meanwhile answers /health and sends every stream's tokens), one call at a time:
        # the tokenizer's split-special-tokens switch is shared state (ChatFormat.literal).
        self.text_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="positronic-text")
        lm.fewest_tokens("")  # the vocabulary's longest entry, read once now rather than by a request
        self.worker = ModelWorker(on_forward=self.metrics.record_batch, threads=settings.threads,
                                  engine_slots=settings.engine_slots, engine_smartkv=settings.engine_smartkv,
                                  engine_compiled=settings.engine_compiled)
        self.pool = SessionPool(lm, self.worker, settings.session_dir, max_sessions=settings.max_sessions,
                                idle_save_s=settings.idle_save_s, on_tick=self.metrics.record_tick)
        self.preparer = Preparer(lm, config, self.worker, self.format, self.off_loop,
                                 history_edits=settings.history_edits)
        self.in_flight = 0
        self._sweeper: asyncio.Task | None = None
        self.closed = False  # close() ran to its end
        self.lost: dict[str, str] = {}  # sessions close() could not checkpoint (id -> why)
        self.stopping = False  # the shutdown has begun: streams are cut, new requests refused
        self.open_requests = 0  # HTTP requests not yet answered to their last byte (app.RequestMetrics)

    async def start(self) -> None:
        if self.settings.engine_compiled:
            await self._warm()
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def _warm(self) -> None:
        """`serve --compile`: the engine of the server's own settings made and its graphs
        compiled before the first request (vLLM captures its graphs at start the same way), so
        that no request waits for one; sessions of other budgets compile theirs when they come."""
        from ..brain.loop import Brain

        clock = time.perf_counter()
        brain = Brain.start(self.lm, self.lm.encode("Hello.") or [0], self.config)
        try:
            made = await self.worker.run(self.worker.warm, brain)
        except Exception as exc:  # serve anyway: the rounds of a graph that failed run eagerly
            log.warning("could not compile the decode rounds (%s: %s); they run eagerly", type(exc).__name__, exc)
            return
        if made:
            log.info("compiled the decode rounds of %d batch sizes in %.0f s", made, time.perf_counter() - clock)

    def begin_shutdown(self) -> None:
        """The shutdown begins (app.GracefulServer calls this before uvicorn waits for the
        requests in flight): a stream is cut at its next token, after every token generated
        has been sent, with a final error event; a whole (non-streamed) reply in flight goes
        on to its end and is answered; a new generation request gets 503."""
        if not self.stopping:
            self.stopping = True
            log.info("shutting down: streams in flight are cut at their next token, replies in flight finish, "
                     "new requests are refused")

    def is_stopping(self) -> bool:
        return self.stopping

    async def close(self) -> None:
        """Graceful shutdown: every session checkpointed, then the model thread stopped. A
        session whose request is still running here was cancelled by uvicorn (its graceful
        shutdown timed out): its client did not get the whole reply, so it is not checkpointed
        (reported as lost). The answers still being sent are waited for (CLOSE_WAIT_S)."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper  # an eviction it had begun lets its session go
        # cut: marked as uvicorn cancelled them, or still held by a request now (it was cancelled)
        cut = {c.id for c in self.pool.loaded.values() if c.cut or (c.lock.locked() and not c.evicting)}
        saved, self.lost = await self.pool.close(cut)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self.open_requests and time.monotonic() < deadline:  # e.g. a 503 for a cancelled request
            await asyncio.sleep(0.01)
        log.info("%d sessions checkpointed to %s", saved, self.settings.session_dir)
        if self.lost:
            log.error("%d sessions could not be checkpointed to %s and are lost: %s", len(self.lost),
                      self.settings.session_dir, "; ".join(f"{sid} ({why})" for sid, why in sorted(self.lost.items())))
        self.worker.close()
        self.text_thread.shutdown(wait=False, cancel_futures=True)
        meeting = self.worker.meeting
        if meeting.forwards:
            log.info("%d model forwards fed %d sequences (%.2f a forward)", meeting.forwards, meeting.fed,
                     meeting.fed / meeting.forwards)
        self.closed = True

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_every_s)
            try:
                await self.pool.sweep()
            except Exception:  # never let the sweeper die silently: the next round tries again
                log.exception("idle-session sweep failed")

    async def off_loop(self, fn: Callable, *args):
        """`fn(*args)` in the text thread: whatever tokenizes, never on the event loop. A
        request cancelled meanwhile still waits for the call to end, so that a call that
        changes its session (Conversation.queue) is over before the session is let go."""
        future = asyncio.wrap_future(self.text_thread.submit(fn, *args))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await future
            raise

    # -- holding a conversation --

    @contextlib.asynccontextmanager
    async def admission(self):
        """A place among the --max-pending requests, or 429."""
        if self.in_flight >= self.settings.max_pending:
            raise APIError(429, f"the server has {self.in_flight} requests in progress (--max-pending); "
                                "try again later", type="rate_limit_error", code="too_many_requests")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str | None):
        """The session's conversation, held for the request (429: no slot; 409: unusable, or held by
        another process)."""
        try:
            conversation = await self.pool.acquire(session_id)
        except PoolFull as exc:
            raise APIError(429, str(exc), type="rate_limit_error", code="too_many_sessions") from None
        except SaveFailed as exc:  # the server's storage, not the client's load: 507, and it is logged
            raise APIError(507, str(exc), type="server_error", code="session_save_failed") from None
        except SessionUnusable as exc:
            raise APIError(409, str(exc), param="user", code="session_unusable") from None
        except SessionInUse as exc:  # run.py or another server holds it: it may be free later
            raise APIError(409, str(exc), param="user", code="session_in_use") from None
        try:
            yield conversation
        finally:
            self.pool.release(conversation)

    async def checkpoint(self, conversation: Conversation, answer: answers.Answer | None, turn: Turn) -> None:
        """The request is done with its session: its keyed answer records the reply, and the
        session is written through to disk (checkpoint_each_request) before the answer's last
        byte, so a client that got its whole answer knows the checkpoint holds it. Not when a
        shutdown cancelled the request (`cut`: its client never got the reply)."""
        with anyio.CancelScope(shield=True):  # a client that left does not stop the record or the write
            # a client that left mid-stream cancelled its request while a tick ran on: that tick's
            # token is the reply's (and its answer's), so the history waits for it too
            await self.worker.settled(conversation)
            if answer is not None:
                answer.reply = turn.reply
            if turn.reply is not None and turn.chat:
                conversation.replied(turn.recorded_text(), again=turn.retried)
            if not self.settings.checkpoint_each_request or conversation.id is None or conversation.cut:
                return
            await self.pool.checkpoint(conversation)

    async def generate(self, request: Request, body: GenerationBody, chat: bool) -> Response:
        """Both generation endpoints: check, hold the conversation, queue the input, then
        answer at once (the whole reply) or as server-sent events. A request that uvicorn
        cancels (its graceful shutdown timed out) is answered 503."""
        try:
            if (body.n or 1) > 1 or rules.prompts_of(body):
                return await self._choices(request, body, chat)
            return await self._generate(request, body, chat)
        except asyncio.CancelledError:
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
            log.warning("a request was cancelled by the shutdown before its reply was finished")
            return replies.shutting_down("the server shut down before the reply was finished; the session does not "
                                         "keep it").response()

    async def _generate(self, request: Request, body: GenerationBody, chat: bool) -> Response:
        begun = await self._begin(request, body, chat)
        if body.stream:
            return replies.streamed(self, begun, body, chat)
        return await replies.whole(self, request, begun, chat)

    async def _begin(self, request: Request, body: GenerationBody, chat: bool) -> Begun:
        """Check the request, take its place (--max-pending) and its conversation, and queue
        its input: what answering it needs. Nothing is held when it raises."""
        arrived = time.perf_counter()
        if self.stopping:
            raise replies.shutting_down("the server is shutting down; try again once it is back")
        rules.check(body, self.lm, self.settings)
        max_tokens = rules.max_tokens_of(body, chat, self.settings)
        if chat:  # every message's content checked before a session is touched
            rules.check_messages(body.messages)
        session_id = rules.session_id(request, body.user)
        key = answers.check_key(request.headers.get(answers.HEADER), session_id)
        top, echo = rules.logprob_options(body, chat, key)
        tools = Tools.of(body) if chat else None
        constraint = await self.off_loop(rules.constraint_of, body, self.lm, tools)  # before a session is touched
        vocab = self.lm.vocab_size
        options = dict(max_tokens=max_tokens, stops=stops_of(body.stop), sampling=rules.sampling(body, vocab),
                       ignore_eos=body.ignore_eos, stop_ids=rules.stop_ids(body, vocab),
                       on_token=self.metrics.record_token, started=arrived, logprobs=top, echo=echo, chat=chat,
                       constraint=constraint, tools=tools)
        held = contextlib.AsyncExitStack()
        try:
            await held.enter_async_context(self.admission())
            conversation = await held.enter_async_context(self.hold(session_id))
            if self.stopping:  # it waited for its session while the shutdown began
                raise replies.shutting_down("the server is shutting down; try again once it is back")
            turn, answer = await self.preparer.begin_turn(conversation, body, chat, key, options)
        except BaseException:
            await held.aclose()
            raise
        return Begun(held, conversation, turn, answer, (ChatWriter if chat else CompletionWriter)(body.model),
                     {"X-Session-Id": session_id} if session_id else None,
                     replies.echo_text(self.lm, body.prompt) if echo else None)

    async def _choices(self, request: Request, body: GenerationBody, chat: bool) -> Response:
        """n > 1 or a list of prompts (choices.py): choice j of prompt i (index i * n + j) is this
        request with that prompt alone, n = 1 and seed + j, each a throwaway sequence, all run
        side by side."""
        base = rules.check_choices(request, body, self.lm, self.settings, self.config.seed)
        n, prompts = body.n or 1, rules.prompts_of(body) or [getattr(body, "prompt", None)]
        update = {"n": 1, **({"stream_options": StreamOptions(include_usage=True)} if body.stream else {})}
        bodies = [body.model_copy(update={**update, "seed": base + index, **({} if chat else {"prompt": prompt})})
                  for prompt in prompts for index in range(n)]
        tasks: list[asyncio.Task] = []
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._begin(request, each, chat)) for each in bodies]
        except BaseExceptionGroup as errors:
            for task in tasks:  # the choices that did begin let go of their places and conversations
                if task.done() and not task.cancelled() and task.exception() is None:
                    await task.result().held.aclose()
            raise errors.exceptions[0] from None
        begun = [task.result() for task in tasks]
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(as_events(merge_events([replies.events(self, one, each, chat)
                                                       for one, each in zip(begun, bodies)], include, n)))
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(replies.reply(self, request, one, chat)) for one in begun]
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None
        answered = [task.result() for task in tasks]
        if any(reply is None for reply in answered):
            return Response(status_code=499)  # the client left
        return JSONResponse(merge_whole(answered, n))

    # -- the other endpoints --

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card(name) for name in self.names]}

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "positronic",
                "root": self.lm.name,  # vLLM's: the model behind a served name
                "max_model_len": self.config.budget}  # vLLM's name for the context a request may fill

    def health(self) -> dict:
        return {"status": "ok", "model": self.names[0], "budget": self.config.budget, "policy": self.config.policy,
                "sessions": {"in_memory": len(self.pool.loaded), "slots_in_use": self.pool.in_use,
                             "max": self.settings.max_sessions, "unsaved": sorted(self.pool.unsaved)},
                "requests_in_flight": self.in_flight, "max_pending": self.settings.max_pending}

    def metrics_text(self) -> str:
        live = {sid: (len(c.brain.state), c.brain.config.budget) for sid, c in self.pool.loaded.items()
                if c.brain is not None}
        states = {"in_memory": len(self.pool.loaded), "throwaway": self.pool.in_use - len(self.pool.loaded),
                  "active": sum(1 for c in self.pool.loaded.values() if c.users)}
        events = {"saved": self.pool.saved, "resumed": self.pool.resumed, "freed": self.pool.freed}
        return self.metrics.render(sessions=live, session_states=states, session_events=events,
                                   in_flight=self.in_flight, save_failures=self.pool.save_failures,
                                   running=len(self.worker.ticking))
