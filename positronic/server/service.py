"""The endpoints' work (`BrainServer`): requests checked, conversations held, turns run,
answers written; and the server's limits (`ServerSettings`). The routes that call it are in
positronic/server/app.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..brain.chat import TurnRefused, turn_limit
from ..brain.loop import BrainConfig
from . import answers
from .history import History
from .logprobs import TokenLogprob, chat_logprobs, completion_logprobs, of_prompt
from .metrics import Metrics
from ..brain.config import logit_bias_text
from .schemas import (IGNORED, APIError, GenerationBody, Message, StreamOptions, message_text, refuse_unknown,
                      stops_of)
from .sessions import (ClientGone, Conversation, ModelWorker, PoolFull, Prepared, SaveFailed, ServerStopping,
                       SessionInUse, SessionPool, SessionUnusable, Turn, check_session_id, evicts_nothing)
from .choices import merge_events, merge_whole
from .streaming import ChatWriter, CompletionWriter, EventStream, as_events
from .text import ChatFormat

log = logging.getLogger("positronic.server.app")

SESSION_HEADER = "x-session-id"
CLOSE_WAIT_S = 5.0  # how long close() waits for the answers in flight to be sent
PROMPT_WHY = "a running session's prompt may add (the budget less the protected rows)"


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


@dataclass
class Begun:
    """A request admitted, its conversation held and its input queued: what answering it needs."""

    held: contextlib.AsyncExitStack  # its place and its conversation, let go when the answer ends
    conversation: Conversation
    turn: Turn
    answer: answers.Answer | None  # its Idempotency-Key's record
    writer: ChatWriter | CompletionWriter
    headers: dict | None
    echoed: str | None  # the prompt's text, when it is echoed


class BrainServer:
    """The endpoints' work: requests checked, conversations held, turns run, answers written.
    One per app; `start()`/`close()` in the app's lifespan."""

    def __init__(self, lm, config: BrainConfig, settings: ServerSettings):
        self.lm, self.config, self.settings = lm, config, settings
        self.created = int(time.time())
        self.metrics = Metrics()
        self.format = ChatFormat(lm)
        # Tokenizing runs here, off the event loop (a 1 MB prompt takes about a second, and the
        # loop meanwhile answers /health and sends every stream's tokens), one call at a time:
        # the tokenizer's split-special-tokens switch is shared state (ChatFormat.literal).
        self.text_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="positronic-text")
        lm.fewest_tokens("")  # the vocabulary's longest entry, read once now rather than by a request
        self.worker = ModelWorker(on_forward=self.metrics.record_batch, threads=settings.threads)
        self.pool = SessionPool(lm, self.worker, settings.session_dir, max_sessions=settings.max_sessions,
                                idle_save_s=settings.idle_save_s, on_tick=self.metrics.record_tick)
        self.in_flight = 0
        self._sweeper: asyncio.Task | None = None
        self.closed = False  # close() ran to its end
        self.lost: dict[str, str] = {}  # sessions close() could not checkpoint (id -> why)
        self.stopping = False  # the shutdown has begun: streams are cut, new requests refused
        self.open_requests = 0  # HTTP requests not yet answered to their last byte (app.RequestMetrics)

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever())

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

    # -- checks shared by both generation endpoints --

    @property
    def max_choices(self) -> int:
        return min(self.settings.max_sessions, self.settings.max_pending)

    def check(self, body: GenerationBody) -> None:
        if body.model != self.lm.name:
            raise APIError(404, f"the model {body.model!r} does not exist here; this server serves {self.lm.name!r}",
                           param="model", code="model_not_found")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of: one candidate per choice is supported (best_of 1; n asks for several "
                                "choices)", param="best_of", code="invalid_value")
        if body.n is not None and not 1 <= body.n <= self.max_choices:
            raise APIError(400, f"n must be in 1..{self.max_choices} (each choice is a sequence of its own: at most "
                                f"--max-sessions and --max-pending), got {body.n}", param="n", code="invalid_value")
        refuse_unknown(body, ignored=IGNORED)
        if body.stream_options is not None:
            refuse_unknown(body.stream_options, "stream_options")

    def max_tokens(self, value: int | None, name: str) -> int:
        if value is None:
            return self.settings.default_max_tokens
        if value < 1:
            raise APIError(400, f"{name} must be at least 1, got {value}", param=name, code="invalid_value")
        if value > self.settings.max_tokens:
            raise APIError(400, f"{name} {value} is above this server's limit of {self.settings.max_tokens}",
                           param=name, code="invalid_value")
        return value

    @staticmethod
    def session_id(request: Request, user: str | None) -> str | None:
        header = request.headers.get(SESSION_HEADER)
        if header is not None and user is not None and header != user:
            raise APIError(400, f"the X-Session-Id header ({header!r}) and the user field ({user!r}) name "
                                "different sessions", param="user", code="invalid_session_id")
        value = header if header is not None else user
        if value is None:
            return None
        try:
            return check_session_id(value)
        except ValueError as exc:
            raise APIError(400, str(exc), param="user" if header is None else None, code="invalid_session_id") from None

    def sampling(self, body: GenerationBody) -> dict:
        """The request's sampling fields as BrainConfig settings for its own tokens (the
        session's own settings stay); 400 for a token id outside the vocabulary."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
        sampling = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
        if sampling.get("top_k") == -1:
            sampling["top_k"] = 0  # vLLM's "off"
        if body.logit_bias is not None:
            bias = {}
            for key, amount in body.logit_bias.items():
                if not (key.isascii() and key.isdigit() and int(key) < self.lm.vocab_size):
                    raise APIError(400, f"logit_bias: {key[:40]!r} is not a token id in 0..{self.lm.vocab_size - 1}",
                                   param="logit_bias", code="invalid_value")
                bias[int(key)] = float(amount)
            sampling["logit_bias"] = logit_bias_text(bias)
        return sampling

    def stop_ids(self, body: GenerationBody) -> set[int]:
        ids = set(body.stop_token_ids or ())
        if any(not 0 <= token < self.lm.vocab_size for token in ids):
            raise APIError(400, f"stop_token_ids: token ids must be in 0..{self.lm.vocab_size - 1}",
                           param="stop_token_ids", code="invalid_value")
        return ids

    def fresh_config(self, seed: int | None) -> BrainConfig:
        return self.config if seed is None else dataclasses.replace(self.config, seed=seed)

    def check_ids(self, ids: list[int]) -> None:
        if any(not 0 <= token < self.lm.vocab_size for token in ids):
            raise APIError(400, f"prompt: token ids must be in 0..{self.lm.vocab_size - 1}", param="prompt",
                           code="invalid_value")

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

    @staticmethod
    def too_long(what: str, tokens: int, limit: int, why: str, param: str, *, at_least: bool = False) -> APIError:
        """`at_least`: `tokens` is a lower bound (LoadedModel.fewest_tokens), found without encoding."""
        return APIError(400, f"{what} is {'at least ' if at_least else ''}{tokens} tokens, more than the {limit} "
                             f"{why}", param=param, code="context_length_exceeded")

    def prompt_limit(self, config: BrainConfig) -> tuple[int, str]:
        """The most tokens a fresh brain may take, and why: the model's positions (a prompt
        past the budget is pruned to it by the session's policy, as `run` does), or the budget
        less the row of the reply's first token when nothing is ever evicted (policy none with
        at_capacity stop)."""
        if evicts_nothing(config):
            return config.budget - 1, ("of the context budget less one row for the reply (policy none with "
                                       "at_capacity stop evicts nothing)")
        return self.lm.max_positions, f"positions of {self.lm.name} (a longer prompt cannot be read at all)"

    async def begin_session(self, conversation: Conversation, ids: list[int], config: BrainConfig,
                            echo: int | None) -> Prepared:
        """A fresh brain on `ids`. Past the budget the policy prunes the prompt (Brain.start);
        with `echo` (the alternatives to list) it prefills the budget's worth instead, their
        log-probabilities exact (a plain forward), and reads the rest token by token, each
        teacher-forced through the bounded cache."""
        if echo is None or len(ids) <= config.budget:
            await self.worker.run(conversation.start, self.lm, ids, config, owner=conversation)
            pruned = len(ids) - conversation.brain.state.rows_per_layer
            echoed = [] if echo is None else await self.worker.run(self.worker.meeting.call, of_prompt, self.lm, ids,
                                                                     echo)  # in the forward thread
            return Prepared(len(ids), echoed, pruned, "exact")
        head = ids[:config.budget]
        await self.worker.run(conversation.start, self.lm, head, config, owner=conversation)
        conversation.queue(forced=ids[config.budget:])
        echoed = await self.worker.run(self.worker.meeting.call, of_prompt, self.lm, head, echo)
        return Prepared(len(ids), echoed, 0, f"exact for the first {len(head)} prompt tokens, then teacher-forced "
                                             "through the session's bounded cache")

    def check_room(self, conversation: Conversation, adding: int, param: str) -> None:
        """A session that evicts nothing (policy none, at_capacity stop) takes a request only if
        its input and the reply's first token fit under its budget; else a 400 and the session
        stays as it was. Other policies make room themselves, tick by tick."""
        brain = conversation.brain
        if not evicts_nothing(brain.config):
            return
        held = brain.state.rows_per_layer + len(conversation.forced) + len(brain.pending_input)  # unread counts
        budget = brain.config.budget
        if held + adding + 1 > budget:
            name = f"session {conversation.id!r}" if conversation.id else "the session"
            raise APIError(400, f"{name} is full: it holds {held} of its {budget} rows and this request adds "
                                f"{adding} more, plus one for the reply; under policy none with at_capacity stop "
                                "nothing is evicted, so the session can take no more (start a new session)",
                           param=param, code="context_length_exceeded")

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

    async def settle(self, conversation: Conversation) -> None:
        """Read what an earlier request left unread (it went away mid-turn), a tick a token, in one job."""
        if conversation.reading:
            await self.worker.run(conversation.settle, owner=conversation)

    # -- preparing a turn: what the request adds to its conversation --

    async def prepare_completion(self, conversation: Conversation, prompt, seed: int | None,
                                 echo: int | None = None) -> Prepared:
        """Queue a completion's prompt: a fresh brain prefills BOS + the prompt; a running
        session reads the prompt's tokens after its context. With `echo`, the prompt tokens'
        log-probabilities where they are prefilled (a running session's: Turn.read)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request is supported", param="prompt",
                               code="invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, list):
            ids = list(prompt)
        else:  # known too long by its length alone: refused before any encoding
            fewest = self.lm.fewest_tokens(prompt)
            if conversation.brain is None:
                limit, why = self.prompt_limit(self.fresh_config(seed))
                if fewest + 1 > limit:  # and the BOS
                    raise self.too_long("the prompt", fewest + 1, limit, why, "prompt", at_least=True)
            elif fewest > (limit := turn_limit(conversation.brain.config)):
                raise self.too_long("the prompt", fewest, limit, PROMPT_WHY, "prompt", at_least=True)
            ids = await self.off_loop(self.lm.encode, prompt)
        self.check_ids(ids)
        if conversation.brain is None:
            config = self.fresh_config(seed)
            sent = len(ids)
            if not isinstance(prompt, list) or ids[:1] != [self.lm.bos_id]:
                ids = [self.lm.bos_id] + ids
            limit, why = self.prompt_limit(config)
            if len(ids) > limit:
                raise self.too_long("the prompt", len(ids), limit, why, "prompt")
            prepared = await self.begin_session(conversation, ids, config, echo)
            prepared.echoed = prepared.echoed[len(ids) - sent:]  # the tokens the client sent (not a BOS added)
            return prepared
        limit = turn_limit(conversation.brain.config)
        if len(ids) > limit:
            raise self.too_long("the prompt", len(ids), limit, PROMPT_WHY, "prompt")
        self.check_room(conversation, len(ids), "prompt")
        await self.settle(conversation)
        conversation.queue(forced=ids)
        return Prepared(len(ids), [], 0, "teacher-forced through the session's bounded cache")

    async def prepare_chat(self, conversation: Conversation, messages: list[Message], seed: int | None) -> int:
        """Queue a chat's new part: a fresh brain prefills the whole conversation in the chat
        template; a running session reads the user messages after the last assistant
        message, each as a user turn, after closing its previous reply. Returns the tokens added."""
        texts = [message_text(message, i) for i, message in enumerate(messages)]
        said = [(m.role, t) for m, t in zip(messages, texts)]
        last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        new = list(range(last + 1, len(messages)))
        if conversation.brain is not None and (not new or any(messages[i].role != "user" for i in new)):
            raise APIError(400, "messages: in a running session a request ends with its new user message(s) after "
                                "the last assistant message (the session remembers the rest)", param="messages",
                           code="invalid_value")
        if conversation.brain is not None and (at := conversation.history.differs(said[:last + 1])) is not None:
            if self.settings.history_edits != "rebuild":
                name = f"session {conversation.id!r}" if conversation.id else "the session"
                raise APIError(409, f"messages.{at}: the conversation's earlier messages differ from {name}'s (an "
                                    "edited or regenerated message?); send the history as the session answered it, or "
                                    "only the new message(s), or start a new session (a server run with "
                                    "--history-edits rebuild starts the session again from the messages instead)",
                               param=f"messages.{at}", code="history_mismatch")
            await self.settle(conversation)  # what it was reading goes with it
            conversation.brain, conversation.history = None, History(None)
            log.info("session %s starts again from a request's edited history", conversation.id)
        if conversation.brain is None:
            config = self.fresh_config(seed)
            limit, why = self.prompt_limit(config)
            if (fewest := 1 + sum(self.lm.fewest_tokens(text.strip()) for _, text in said)) > limit:
                raise self.too_long("the conversation", fewest, limit, why, "messages", at_least=True)
            ids = await self.off_loop(self.format.conversation,
                                      [{"role": role, "content": text} for role, text in said])
            if len(ids) > limit:
                raise self.too_long("the conversation", len(ids), limit, why, "messages")
            prepared = await self.begin_session(conversation, ids, config, None)
            conversation.history = History(said)
            return prepared
        limit = turn_limit(conversation.brain.config)
        for i in new:
            if (fewest := self.lm.fewest_tokens(texts[i].strip())) > limit:
                raise self.too_long(f"messages.{i} as a user turn", fewest, limit, "a turn may take here (the "
                                    "budget less the protected rows)", "messages", at_least=True)
        try:
            turns = await self.off_loop(lambda: [self.format.user_turn(texts[i], limit) for i in new])
        except TurnRefused as exc:
            raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from None
        await self.settle(conversation)  # input an earlier request left unread (already accepted)

        def queue() -> int:  # in the text thread: the turns are tokenized again as the brain takes them
            closing = self.format.reply_end(conversation.last_token())
            adding = len(closing) + sum(map(len, turns))
            self.check_room(conversation, adding, "messages")
            conversation.queue(forced=closing, turns=[texts[i] for i in new])
            return adding

        adding = await self.off_loop(queue)
        conversation.history.said([said[i] for i in new])
        return Prepared(adding)

    # -- answers --

    def extension(self, conversation: Conversation, turn: Turn) -> dict:
        """The session's state after the request (a field OpenAI clients ignore): its counts,
        whether its checkpoint holds this reply, for a retried request (Idempotency-Key)
        whether the reply was replayed (nothing generated) or a cut one continued, prompt tokens
        the policy pruned at once, and how echoed log-probabilities were computed."""
        brain = conversation.brain
        state = {"session": conversation.id, "tick": brain.tick, "live_length": brain.state.rows_per_layer,
                 "budget": brain.config.budget, "ledger_tokens": len(brain.state.mirror.ledger),
                 "checkpointed": conversation.id is not None and not conversation.dirty}
        if turn.retried:
            state["retried"] = "replayed" if turn.generated == 0 else "continued"
        if turn.prepared.pruned:
            state["pruned_prompt_tokens"] = turn.prepared.pruned
        if turn.echo and turn.logprobs is not None:
            state["logprobs"] = turn.prepared.how
        return state

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
                conversation.replied(turn.reply.text, again=turn.retried)
            if not self.settings.checkpoint_each_request or conversation.id is None or conversation.cut:
                return
            await self.pool.checkpoint(conversation)

    async def begin_turn(self, conversation: Conversation, body: GenerationBody, chat: bool, key: str | None,
                         options: dict) -> tuple[Turn, answers.Answer | None]:
        """The request's turn (`options`: Turn's reply settings; `turn.prepared`: what its input
        did) and its keyed answer: a retried key (answers.py) takes up its earlier reply instead
        of queueing the input again."""
        if key is not None:
            print_ = answers.fingerprint(body, chat)
            if (answer := conversation.answers.find(key, print_)) is not None:
                reply = conversation.answers.resumed_reply(self.lm, options["max_tokens"], options["stops"],
                                                           options["ignore_eos"], options["stop_ids"])
                turn = Turn(conversation, self.worker, self.lm, reply=reply, retried=True, **options)
                turn.prepared = Prepared(answer.prompt_tokens)
                return turn, answer
        if chat:
            prepared = await self.prepare_chat(conversation, body.messages, body.seed)
        else:
            echo = options["logprobs"] if options["echo"] else None
            prepared = await self.prepare_completion(conversation, body.prompt, body.seed, echo)
        if key is None:
            conversation.answers.forget()
            answer = None
        else:
            answer = conversation.answers.begin(key, print_, prepared.tokens)
        turn = Turn(conversation, self.worker, self.lm, **options)
        turn.prepared = prepared
        return turn, answer

    @staticmethod
    def usage(turn: Turn) -> dict:
        prompt_tokens, generated = turn.prepared.tokens, turn.reply.tokens if turn.reply else 0
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}
        if turn.prepared.pruned:  # the policy pruned a prompt past the budget (also in the positronic field)
            usage["prompt_tokens_pruned"] = turn.prepared.pruned
        return usage

    def logprob_options(self, body: GenerationBody, chat: bool, key: str | None) -> tuple[int | None, bool]:
        """(the alternatives to list per token, None: no logprobs; whether to echo the prompt)."""
        if chat:
            if body.top_logprobs is not None and not body.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
            top, echo = (body.top_logprobs or 0) if body.logprobs else None, False
        else:
            top, echo = body.logprobs, body.echo
        if key is not None and (top is not None or echo):
            raise APIError(400, "logprobs and echo cannot be combined with an Idempotency-Key (a replayed answer does "
                                "not keep them)", param="logprobs" if top is not None else "echo",
                           code="invalid_value")
        return top, echo

    def echo_text(self, prompt) -> str:
        """The prompt as echo returns it: its text (token ids decoded)."""
        prompt = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else prompt
        return prompt if isinstance(prompt, str) else self.lm.decode(list(prompt))

    def logprobs_of(self, chat: bool, entries: list[TokenLogprob], offset: int = 0) -> dict:
        return chat_logprobs(self.lm, entries) if chat else completion_logprobs(self.lm, entries, offset)

    @staticmethod
    def shutting_down(message: str) -> APIError:
        return APIError(503, message, type="server_error", code="server_shutting_down")

    async def generate(self, request: Request, body: GenerationBody, chat: bool) -> Response:
        """Both generation endpoints: check, hold the conversation, queue the input, then
        answer at once (the whole reply) or as server-sent events. A request that uvicorn
        cancels (its graceful shutdown timed out) is answered 503."""
        try:
            if (body.n or 1) > 1:
                return await self._choices(request, body, chat)
            return await self._generate(request, body, chat)
        except asyncio.CancelledError:
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
            log.warning("a request was cancelled by the shutdown before its reply was finished")
            return self.shutting_down("the server shut down before the reply was finished; the session does not "
                                      "keep it").response()

    async def _generate(self, request: Request, body: GenerationBody, chat: bool) -> Response:
        begun = await self._begin(request, body, chat)
        if body.stream:
            return EventStream(as_events(self._events(begun, body, chat)), headers=begun.headers)
        return await self._whole(request, begun, chat)

    async def _begin(self, request: Request, body: GenerationBody, chat: bool) -> Begun:
        """Check the request, take its place (--max-pending) and its conversation, and queue
        its input: what answering it needs. Nothing is held when it raises."""
        arrived = time.perf_counter()
        if self.stopping:
            raise self.shutting_down("the server is shutting down; try again once it is back")
        self.check(body)
        if chat:
            max_tokens = self.max_tokens(body.max_completion_tokens if body.max_completion_tokens is not None
                                         else body.max_tokens,
                                         "max_completion_tokens" if body.max_completion_tokens is not None
                                         else "max_tokens")
        else:
            max_tokens = self.max_tokens(body.max_tokens, "max_tokens")
        if chat:  # every message's content checked before a session is touched
            for i, message in enumerate(body.messages):
                message_text(message, i)
        session_id = self.session_id(request, body.user)
        key = answers.check_key(request.headers.get(answers.HEADER), session_id)
        top, echo = self.logprob_options(body, chat, key)
        options = dict(max_tokens=max_tokens, stops=stops_of(body.stop), sampling=self.sampling(body),
                       ignore_eos=body.ignore_eos, stop_ids=self.stop_ids(body), on_token=self.metrics.record_token,
                       started=arrived, logprobs=top, echo=echo, chat=chat)
        held = contextlib.AsyncExitStack()
        try:
            await held.enter_async_context(self.admission())
            conversation = await held.enter_async_context(self.hold(session_id))
            if self.stopping:  # it waited for its session while the shutdown began
                raise self.shutting_down("the server is shutting down; try again once it is back")
            turn, answer = await self.begin_turn(conversation, body, chat, key, options)
        except BaseException:
            await held.aclose()
            raise
        return Begun(held, conversation, turn, answer, (ChatWriter if chat else CompletionWriter)(self.lm.name),
                     {"X-Session-Id": session_id} if session_id else None,
                     self.echo_text(body.prompt) if echo else None)

    def _events(self, begun: Begun, body: GenerationBody, chat: bool):
        """The streamed reply's payloads (dicts, then "[DONE]")."""
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return self.events(begun.held, begun.conversation, begun.turn, begun.answer, begun.writer, usage, chat,
                           begun.echoed)

    async def _whole(self, request: Request, begun: Begun, chat: bool) -> Response:
        whole = await self._reply(request, begun, chat)
        if whole is None:
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(whole, headers=begun.headers)

    async def _reply(self, request: Request, begun: Begun, chat: bool) -> dict | None:
        """The whole reply, the answer object (the turn runs here); None when the client left."""
        conversation, turn, echoed = begun.conversation, begun.turn, begun.echoed
        async with begun.held:
            try:
                async with contextlib.aclosing(turn.pieces(gone=request.is_disconnected)) as pieces:
                    async for _ in pieces:
                        pass
            except ClientGone:
                return None
            except asyncio.CancelledError:  # only uvicorn's shutdown cancels a whole reply (a client that
                conversation.cut = True     # leaves is polled): marked before the session is let go
                raise
            finally:
                await self.checkpoint(conversation, begun.answer, turn)
                self.metrics.record_reply(0 if turn.retried else turn.prepared.tokens, turn.generated)
            entries = (turn.prepared.echoed + turn.read if echoed is not None else []) + turn.entries
            logprobs = self.logprobs_of(chat, entries) if turn.logprobs is not None else None
            text = (echoed or "") + turn.reply.text
            whole = begun.writer.whole(text, turn.reply.finish_reason, self.usage(turn), logprobs)
            whole["positronic"] = self.extension(conversation, turn)
        return whole

    async def _choices(self, request: Request, body: GenerationBody, chat: bool) -> Response:
        """n > 1 (choices.py): choice i is this request with n = 1 and seed + i, each a throwaway
        sequence, all run side by side."""
        self.check(body)
        if self.session_id(request, body.user) is not None:
            raise APIError(400, "n > 1 is for requests without a session: a session continues one conversation, and "
                                "each choice is a conversation of its own (drop the user field and the X-Session-Id "
                                "header)", param="n", code="invalid_value")
        if request.headers.get(answers.HEADER) is not None:
            raise APIError(400, "n > 1 cannot be combined with an Idempotency-Key (a key keeps one answer of a "
                                "session)", param="n", code="invalid_value")
        base = self.config.seed if body.seed is None else body.seed
        if base + body.n > 2**63:
            raise APIError(400, f"seed: choice {body.n - 1} would sample with seed {base + body.n - 1}, past 2**63 - 1",
                           param="seed", code="invalid_value")
        update = {"n": 1, **({"stream_options": StreamOptions(include_usage=True)} if body.stream else {})}
        bodies = [body.model_copy(update={**update, "seed": base + index}) for index in range(body.n)]
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
            return EventStream(as_events(merge_events([self._events(one, each, chat)
                                                       for one, each in zip(begun, bodies)], include)))
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._reply(request, one, chat)) for one in begun]
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None
        replies = [task.result() for task in tasks]
        if any(reply is None for reply in replies):
            return Response(status_code=499)  # the client left
        return JSONResponse(merge_whole(replies))

    async def events(self, held: contextlib.AsyncExitStack, conversation: Conversation, turn: Turn,
                     answer: answers.Answer | None, writer, include_usage: bool, chat: bool, echoed: str | None):
        """The reply's server-sent events, as payloads (`as_events` puts them on the wire): the
        opening chunk, a chunk per piece of text, the
        closing chunk (finish reason, and the session's state: checkpointed by then), the usage
        chunk if asked, `data: [DONE]`. An error after the first byte becomes an error event; so
        does the shutdown, at the next token, once every token generated has been sent (the
        session keeps just those, and a retry with its Idempotency-Key continues the reply).
        With echo the prompt comes first, in a chunk of its own; with logprobs each chunk
        carries its tokens' (a token whose text was held back rides with the next chunk)."""
        listed = turn.logprobs is not None
        sent, offset = 0, 0  # entries sent; characters sent (a completion's text_offset)

        def logprobs(entries: list[TokenLogprob]) -> dict | None:
            return self.logprobs_of(chat, entries, offset) if listed else None

        rest = ""  # what a reply the shutdown cut was holding back: sent before the error event
        try:
            async with held:
                checkpointed = False
                try:
                    if (opening := writer.opening()) is not None:
                        yield opening
                    # closed as soon as this stream is (a client that left): its job stops before its next tick
                    async with contextlib.aclosing(turn.pieces(stop=self.is_stopping)) as pieces:
                        async for piece in pieces:
                            if echoed is not None:  # the prompt was read by now (its logprobs too)
                                yield writer.piece(echoed, logprobs(turn.prepared.echoed + turn.read))
                                offset, echoed = len(echoed), None
                            new, sent = turn.entries[sent : turn.ready], turn.ready
                            yield writer.piece(piece, logprobs(new))
                            offset += len(piece)
                    if echoed is not None:
                        yield writer.piece(echoed, logprobs(turn.prepared.echoed + turn.read))
                    await self.checkpoint(conversation, answer, turn)
                    checkpointed = True
                    closing = writer.closing(turn.reply.finish_reason,
                                             logprobs(turn.entries[sent:]) if sent < len(turn.entries) else None)
                    closing["positronic"] = self.extension(conversation, turn)
                    yield closing
                    if include_usage:
                        yield writer.usage(self.usage(turn))
                except ServerStopping:
                    if turn.reply is not None:  # cut before the checkpoint: it records the reply as sent
                        rest = turn.reply.cut()
                    raise
                except asyncio.CancelledError:
                    if self.stopping:  # uvicorn's shutdown timed out on this stream (not a client leaving)
                        conversation.cut = True
                    raise
                finally:
                    if not checkpointed:  # (it waits for a tick left running: its token is counted too)
                        await self.checkpoint(conversation, answer, turn)
                    self.metrics.record_reply(0 if turn.retried else turn.prepared.tokens, turn.generated)
        except ServerStopping:
            if rest:
                yield writer.piece(rest)
            generated = turn.reply.tokens if turn.reply else 0
            yield self.shutting_down(f"the server is shutting down: the reply was cut after {generated} tokens "
                                         "(all sent; the session keeps them)").body()
        except Exception as exc:
            log.exception("a streamed request failed")
            yield APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error").body()
        yield "[DONE]"

    # -- the other endpoints --

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.lm.name, "object": "model", "created": self.created, "owned_by": "positronic",
                "max_model_len": self.config.budget}  # vLLM's name for the context a request may fill

    def health(self) -> dict:
        return {"status": "ok", "model": self.lm.name, "budget": self.config.budget, "policy": self.config.policy,
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
                                   in_flight=self.in_flight, save_failures=self.pool.save_failures)

