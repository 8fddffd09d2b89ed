"""A turn: one request's part of its conversation, its ticks and the stream of its tokens.

    turn = Turn(conversation, worker, lm, max_tokens=64)
    async for piece in turn.pieces(gone=request.is_disconnected): ...   # on the event loop

`pieces()` runs the whole turn, the input queued for it read and then its reply generated, as
ONE job of the model worker (`ModelWorker.stream`, `Turn._run`): in the forward thread, a tick
at a time, each tick's forward shared with the other sessions' in the same round. After each
tick the job posts (the token's text, entries ready) back to the event loop, where `pieces()`
yields the text as it becomes sendable. Before each tick the job looks whether to go on: `halt`
(a threading.Event that `pieces()` sets when it ends: closed by a stream whose client left, or
ClientGone when `gone()` says so) and `stop()` (the server shutting down: ServerStopping, at
the next token boundary, once every token made was yielded). A tick already begun always ends,
and its token is the reply's.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection

import torch

from ..brain.loop import TickRecord
from .conversation import Conversation
from .logprobs import TokenLogprob, of_logits
from .text import Reply
from .hermes import call_text
from .worker import ModelWorker

MAX_FAILED_TICKS = 3  # ticks in a row that fail (rebuilt, nothing added) before a request gives up


class ClientGone(Exception):
    """The client went away: the request's generation stops."""


class ServerStopping(Exception):
    """The server is shutting down: the request's generation stops at a token boundary."""


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
                 logprobs: int | None = None, echo: bool = False, chat: bool = False, constraint=None, tools=None):
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
        self.prepared = Prepared(0)  # what its input did (Preparer.begin_turn)
        # the grammar its reply keeps to (brain/grammar.py; rules.constraint_of), at the reply's end so far
        self.constraint = constraint
        self.tools = tools  # the functions the reply may call (tools.py), or None
        if constraint is not None and reply is not None:
            for token_id in reply.ids:  # a retried reply's tokens were drawn under the same grammar
                constraint.advance(token_id)

    @property
    def generated(self) -> int:
        """Tokens this request generated (a retry's earlier part not counted)."""
        return (self.reply.tokens if self.reply is not None else 0) - self.earlier_tokens

    def tool_calls(self) -> tuple[str, list[dict]] | None:
        """(content, OpenAI's tool_calls) when the finished reply calls the request's tools."""
        if self.tools is None or self.reply is None or self.reply.finish_reason != "stop":
            return None
        return self.tools.calls(self.reply.text)

    def recorded_text(self) -> str:
        """The reply as the session's history keeps it: its text, or for calls the text a client
        sending them back is read as (tools.call_text), so that the history matches it."""
        made = self.tool_calls()
        if made is None:
            return self.reply.text
        content, calls = made
        return call_text([(call["function"]["name"], call["function"]["arguments"]) for call in calls], content)

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
        if self.reply is not None and self.reply.done:
            return
        conversation.brain.constraint = self.constraint  # its draws only: the input it reads is given
        try:
            self._ticks(halt, stopping, post)
        finally:
            conversation.brain.constraint = None

    def _ticks(self, halt: threading.Event, stopping: Callable[[], bool], post: Callable[[object], None]) -> None:
        conversation = self.conversation
        # the turn's ticks: rounds of the worker's engine where its settings run there, else its brain's own
        with conversation.decoding(self.worker.engine_for(conversation.brain), self.sampling) as ticks:
            if self.reply is None:
                while conversation.reading:
                    if halt.is_set() or stopping():
                        return
                    self._read_one(ticks.read)
                    post((None, len(self.entries)))
                self.reply = Reply(self.lm, conversation.last_token(), self.max_tokens, self.stops,
                                   ignore_eos=self.ignore_eos, stop_ids=self.stop_ids)
            failed = 0
            while not self.reply.done:
                if halt.is_set() or stopping():
                    return
                record, piece = self._next_token(ticks.generate)
                if record.rebuilt:  # the tick failed and added nothing (the state was rebuilt)
                    failed += 1
                    if failed >= MAX_FAILED_TICKS:
                        raise RuntimeError(f"{failed} ticks in a row failed: {record.error}")
                    continue
                failed = 0
                post(((piece,), len(self.entries)))

    def _next_token(self, tick: Callable[[], TickRecord]) -> tuple[TickRecord, str]:
        """On the model worker: one tick, and its token taken into the reply in the same job, so
        that a token the brain took is always the reply's (a request cancelled while the job
        runs, by a client leaving, loses the text's piece but not the token: a retry sends it)."""
        logits = self.conversation.next_logits() if self.logprobs is not None else None
        record = tick()
        if record.rebuilt:
            return record, ""
        kept = len(self.reply.ids)
        complete = self.constraint is not None and self.constraint.done
        piece = self.reply.add(record.token_id, stopped=record.stopped, complete=complete)
        if logits is not None and len(self.reply.ids) > kept:  # a token of the text (not the one ending it)
            self.entries.append(self._entry(logits, record.token_id))
        return record, piece

    def _read_one(self, read: Callable[[], TickRecord | None]) -> None:
        """On the model worker: the next input token read (`read`: Conversation.read_one or its
        engine round), with its log-probability under the context before it when `echo` asks."""
        logits = self.conversation.next_logits() if self.echo else None
        record = read()
        if logits is not None and record is not None and not record.rebuilt:
            self.read.append(self._entry(logits, record.token_id))

    def _entry(self, logits, token_id: int) -> TokenLogprob:
        if not bool(torch.isfinite(logits).all()):  # the tick rebuilt the cache and drew from new logits
            return TokenLogprob(token_id, None)
        return of_logits(logits, token_id, self.logprobs or 0)
