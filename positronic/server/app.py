"""An OpenAI-compatible HTTP server over the brain (`positronic serve`, issue 17).

    POST /v1/completions        text in, text out; "stream": true for server-sent events
    POST /v1/chat/completions   messages in, the assistant's reply out (the model's chat template)
    GET  /v1/models             the one model served
    GET  /v1/sessions/{id}      a session's counts, transcript and live text (an extension)
    GET  /health                liveness, sessions, requests in flight
    GET  /metrics               Prometheus text (positronic/server/metrics.py)

Each conversation is a brain of its own (positronic/server/sessions.py): the session id is the
request's `user` field or its `X-Session-Id` header (1-64 of A-Z a-z 0-9 _ -); a request with
neither gets a fresh brain that is thrown away after it. A session's first request prefills its
prompt (at most the budget); each later one appends only its new part to the live brain: for a
chat, the messages after the last assistant message (user messages: earlier ones are the
session's own memory and are not read again), for a completion, its prompt text, at most a
turn's limit (the budget less the protected rows, chat.turn_limit). Generation goes on inside
the budget as in a run: the policy evicts, repairs, recalls; replies end at max_tokens, the
end-of-sequence token (unless `ignore_eos`, as in vLLM and llama.cpp) or a stop string.
`temperature` and `top_p` apply to the request's own tokens; `seed` to a brain the request
creates.

Bad requests get a 4xx JSON body in OpenAI's error shape, {"error": {"message", "type",
"param", "code"}}: bad JSON or fields (400), an unknown model (404), a prompt or turn over
the budget (400, context_length_exceeded), a bad session id (400), a body over --max-body
(413), more than --max-pending requests or every session slot busy (429), a checkpoint that
cannot be resumed (409). A client that disconnects stops its request's generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..brain.chat import TurnRefused, turn_limit
from ..brain.loop import BrainConfig
from .metrics import Metrics
from .sessions import (ClientGone, Conversation, ModelWorker, PoolFull, SessionPool, SessionUnusable, Turn,
                              check_session_id)
from .text import ChatFormat

log = logging.getLogger("positronic.server.app")

MAX_STOPS = 4
MAX_STOP_CHARS = 256
SESSION_HEADER = "x-session-id"
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


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


class APIError(Exception):
    """A request the server refuses, with its HTTP status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# -- request bodies ---------------------------------------------------------------------------

Number = Annotated[float, Field(strict=True)]  # a JSON number, not a string of one


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class GenerationBody(BaseModel):
    """What both generation endpoints take; other OpenAI fields are accepted and ignored,
    except those in UNSUPPORTED (refused unless empty)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = 1
    best_of: StrictInt | None = None
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # vLLM's and llama.cpp's extension: generate max_tokens whatever comes


class CompletionBody(GenerationBody):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[ContentPart] | None = None


class ChatBody(GenerationBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None


async def read_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's JSON body as `model`, or a 400 naming the first problem."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        raise APIError(400, f"{param}: {error['msg']}" if param else error["msg"], param=param,
                       code="invalid_value" if param else "invalid_request") from None


def message_text(message: Message, index: int) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages.{index}.content: only text parts are supported, not {part.type!r}",
                           param=f"messages.{index}.content", code="invalid_value")
        texts.append(part.text)
    return "".join(texts)


def stops_of(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters",
                       param="stop", code="invalid_value")
    return [s for s in stops if s]


def sse(data: dict | str) -> str:
    """One server-sent event in the OpenAI wire format."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose iterator is closed however the response ends (a client that
    went away included), so the request lets go of its conversation at once."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


# -- middleware -------------------------------------------------------------------------------

class BodyLimit:
    """Refuses a request body over `limit` bytes with 413: at once when its Content-Length
    says so, else when the bytes read pass it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is larger than this server's limit of {self.limit} bytes",
                             code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await too_large.response()(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise too_large
            return message

        await self.app(scope, limited, send)


class RequestMetrics:
    """Counts every request by endpoint and status, and its latency to the last byte sent."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "/v1/sessions" if path.startswith("/v1/sessions/") else "other"
        start, status = time.perf_counter(), 500

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.record_request(endpoint, status, time.perf_counter() - start)


# -- the service ------------------------------------------------------------------------------

class BrainServer:
    """The endpoints' work: requests checked, conversations held, turns run, answers written.
    One per app; `start()`/`close()` in the app's lifespan."""

    def __init__(self, lm, config: BrainConfig, settings: ServerSettings):
        self.lm, self.config, self.settings = lm, config, settings
        self.created = int(time.time())
        self.metrics = Metrics()
        self.format = ChatFormat(lm)
        self.worker = ModelWorker()
        self.pool = SessionPool(lm, self.worker, settings.session_dir, max_sessions=settings.max_sessions,
                                idle_save_s=settings.idle_save_s, on_tick=self.metrics.record_tick)
        self.in_flight = 0
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def close(self) -> None:
        """Graceful shutdown: every session checkpointed, then the model thread stopped."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        saved = await self.pool.close()
        log.info("%d sessions checkpointed to %s", saved, self.settings.session_dir)
        self.worker.close()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_every_s)
            try:
                await self.pool.sweep()
            except Exception:  # never let the sweeper die silently: the next round tries again
                log.exception("idle-session sweep failed")

    # -- checks shared by both generation endpoints --

    def check(self, body: GenerationBody) -> None:
        if body.model != self.lm.name:
            raise APIError(404, f"the model {body.model!r} does not exist here; this server serves {self.lm.name!r}",
                           param="model", code="model_not_found")
        if body.n not in (None, 1) or body.best_of not in (None, 1):
            name = "n" if body.n not in (None, 1) else "best_of"
            raise APIError(400, f"{name}: only one choice per request is supported", param=name,
                           code="invalid_value")
        for name in UNSUPPORTED:
            if (body.model_extra or {}).get(name) not in (None, False, 0, "", [], {}):
                raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported")

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
        return {name: getattr(body, name) for name in ("temperature", "top_p") if getattr(body, name) is not None}

    def fresh_config(self, seed: int | None) -> BrainConfig:
        return self.config if seed is None else dataclasses.replace(self.config, seed=seed)

    def check_ids(self, ids: list[int]) -> None:
        if any(not 0 <= token < self.lm.vocab_size for token in ids):
            raise APIError(400, f"prompt: token ids must be in 0..{self.lm.vocab_size - 1}", param="prompt",
                           code="invalid_value")

    @staticmethod
    def too_long(what: str, tokens: int, limit: int, why: str, param: str) -> APIError:
        return APIError(400, f"{what} is {tokens} tokens, more than the {limit} {why}", param=param,
                        code="context_length_exceeded")

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
        """The session's conversation, held for the request (429: no slot; 409: unusable)."""
        try:
            conversation = await self.pool.acquire(session_id)
        except PoolFull as exc:
            raise APIError(429, str(exc), type="rate_limit_error", code="too_many_sessions") from None
        except SessionUnusable as exc:
            raise APIError(409, str(exc), param="user", code="session_unusable") from None
        try:
            yield conversation
        finally:
            self.pool.release(conversation)

    async def settle(self, conversation: Conversation) -> None:
        """Read what an earlier request left unread (it went away mid-turn), token by token."""
        while conversation.reading:
            await self.worker.run(conversation.read_one)

    # -- preparing a turn: what the request adds to its conversation --

    async def prepare_completion(self, conversation: Conversation, prompt, seed: int | None) -> int:
        """Queue a completion's prompt: a fresh brain prefills BOS + the prompt; a running
        session reads the prompt's tokens after its context. Returns the tokens added."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request is supported", param="prompt",
                               code="invalid_value")
            prompt = prompt[0]
        ids = list(prompt) if isinstance(prompt, list) else self.lm.encode(prompt)
        self.check_ids(ids)
        if conversation.brain is None:
            config = self.fresh_config(seed)
            if not isinstance(prompt, list) or ids[:1] != [self.lm.bos_id]:
                ids = [self.lm.bos_id] + ids
            if len(ids) > config.budget:
                raise self.too_long("the prompt", len(ids), config.budget, "of the context budget", "prompt")
            await self.worker.run(conversation.start, self.lm, ids, config)
            return len(ids)
        limit = turn_limit(conversation.brain.config)
        if len(ids) > limit:
            raise self.too_long("the prompt", len(ids), limit, "a running session's prompt may add (the budget less "
                                "the protected rows)", "prompt")
        await self.settle(conversation)
        conversation.queue(forced=ids)
        return len(ids)

    async def prepare_chat(self, conversation: Conversation, messages: list[Message], seed: int | None) -> int:
        """Queue a chat's new part: a fresh brain prefills the whole conversation in the chat
        template; a running session reads the user messages after the last assistant
        message, each as a user turn, after closing its previous reply. Returns the tokens added."""
        texts = [message_text(message, i) for i, message in enumerate(messages)]
        if conversation.brain is None:
            config = self.fresh_config(seed)
            ids = self.format.conversation([{"role": m.role, "content": t} for m, t in zip(messages, texts)])
            if len(ids) > config.budget:
                raise self.too_long("the conversation", len(ids), config.budget, "of the context budget", "messages")
            await self.worker.run(conversation.start, self.lm, ids, config)
            return len(ids)
        last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        new = list(range(last + 1, len(messages)))
        if not new or any(messages[i].role != "user" for i in new):
            raise APIError(400, "messages: in a running session a request ends with its new user message(s) after "
                                "the last assistant message (the session remembers the rest)", param="messages",
                           code="invalid_value")
        limit = turn_limit(conversation.brain.config)
        try:
            turns = [self.format.user_turn(texts[i], limit) for i in new]
        except TurnRefused as exc:
            raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from None
        await self.settle(conversation)
        closing = self.format.reply_end(conversation.last_token())
        conversation.queue(forced=closing, turns=[texts[i] for i in new])
        return len(closing) + sum(map(len, turns))

    # -- answers --

    def extension(self, conversation: Conversation) -> dict:
        """The session's state after the request (a field OpenAI clients ignore)."""
        brain = conversation.brain
        return {"session": conversation.id, "tick": brain.tick, "live_length": brain.state.rows_per_layer,
                "budget": brain.config.budget, "ledger_tokens": len(brain.state.mirror.ledger)}

    @staticmethod
    def usage(prompt_tokens: int, turn: Turn) -> dict:
        generated = turn.reply.tokens if turn.reply else 0
        return {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated}

    async def generate(self, request: Request, body: GenerationBody, chat: bool) -> Response:
        """Both generation endpoints: check, hold the conversation, queue the input, then
        answer at once (the whole reply) or as server-sent events."""
        self.check(body)
        if chat:
            max_tokens = self.max_tokens(body.max_completion_tokens if body.max_completion_tokens is not None
                                         else body.max_tokens,
                                         "max_completion_tokens" if body.max_completion_tokens is not None
                                         else "max_tokens")
        else:
            max_tokens = self.max_tokens(body.max_tokens, "max_tokens")
        stops = stops_of(body.stop)
        session_id = self.session_id(request, body.user)
        held = contextlib.AsyncExitStack()
        try:
            await held.enter_async_context(self.admission())
            conversation = await held.enter_async_context(self.hold(session_id))
            if chat:
                prompt_tokens = await self.prepare_chat(conversation, body.messages, body.seed)
            else:
                prompt_tokens = await self.prepare_completion(conversation, body.prompt, body.seed)
        except BaseException:
            await held.aclose()
            raise
        turn = Turn(conversation, self.worker, self.lm, max_tokens=max_tokens, stops=stops,
                    sampling=self.sampling(body), ignore_eos=body.ignore_eos)
        writer = (ChatWriter if chat else CompletionWriter)(self.lm.name)
        headers = {"X-Session-Id": session_id} if session_id else None
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(self.events(held, conversation, turn, writer, prompt_tokens, usage), headers=headers)
        async with held:
            try:
                async for _ in turn.pieces(gone=request.is_disconnected):
                    pass
            except ClientGone:
                return Response(status_code=499)  # nobody reads it
            finally:
                self.metrics.record_reply(prompt_tokens, turn.reply.tokens if turn.reply else 0)
            answer = writer.whole(turn.reply.text, turn.reply.finish_reason, self.usage(prompt_tokens, turn))
            answer["positronic"] = self.extension(conversation)
        return JSONResponse(answer, headers=headers)

    async def events(self, held: contextlib.AsyncExitStack, conversation: Conversation, turn: Turn, writer,
                     prompt_tokens: int, include_usage: bool):
        """The reply as server-sent events: the opening chunk, a chunk per piece of text, the
        closing chunk (finish reason, and the session's state), the usage chunk if asked,
        `data: [DONE]`. An error after the first byte becomes an error event."""
        try:
            async with held:
                try:
                    if (opening := writer.opening()) is not None:
                        yield sse(opening)
                    async for piece in turn.pieces():
                        yield sse(writer.piece(piece))
                    closing = writer.closing(turn.reply.finish_reason)
                    closing["positronic"] = self.extension(conversation)
                    yield sse(closing)
                    if include_usage:
                        yield sse(writer.usage(self.usage(prompt_tokens, turn)))
                finally:
                    self.metrics.record_reply(prompt_tokens, turn.reply.tokens if turn.reply else 0)
        except Exception as exc:
            log.exception("a streamed request failed")
            yield sse(APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error").body())
        yield sse("[DONE]")

    # -- the other endpoints --

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.lm.name, "object": "model", "created": self.created, "owned_by": "positronic"}

    def health(self) -> dict:
        return {"status": "ok", "model": self.lm.name, "budget": self.config.budget, "policy": self.config.policy,
                "sessions": {"in_memory": len(self.pool.loaded), "slots_in_use": self.pool.in_use,
                             "max": self.settings.max_sessions},
                "requests_in_flight": self.in_flight, "max_pending": self.settings.max_pending}

    def metrics_text(self) -> str:
        live = {sid: (len(c.brain.state), c.brain.config.budget) for sid, c in self.pool.loaded.items()
                if c.brain is not None}
        states = {"in_memory": len(self.pool.loaded), "throwaway": self.pool.in_use - len(self.pool.loaded),
                  "active": sum(1 for c in self.pool.loaded.values() if c.users)}
        events = {"saved": self.pool.saved, "resumed": self.pool.resumed, "freed": self.pool.freed}
        return self.metrics.render(sessions=live, session_states=states, session_events=events,
                                   in_flight=self.in_flight)


class CompletionWriter:
    """/v1/completions answers: `text_completion` objects, whole or in chunks."""

    def __init__(self, model: str):
        self.model, self.id, self.created = model, f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def _object(self, text: str, finish_reason: str | None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        return {**self._object(text, finish_reason), "usage": usage}

    def opening(self) -> dict | None:
        return None

    def piece(self, text: str) -> dict:
        return self._object(text, None)

    def closing(self, finish_reason: str) -> dict:
        return self._object("", finish_reason)

    def usage(self, usage: dict) -> dict:
        return {**self._object("", None), "choices": [], "usage": usage}


class ChatWriter:
    """/v1/chat/completions answers: `chat.completion`, or `chat.completion.chunk`s."""

    def __init__(self, model: str):
        self.model, self.id, self.created = model, f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def _chunk(self, delta: dict, finish_reason: str | None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish_reason}], "usage": usage}

    def opening(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def piece(self, text: str) -> dict:
        return self._chunk({"content": text}, None)

    def closing(self, finish_reason: str) -> dict:
        return self._chunk({}, finish_reason)

    def usage(self, usage: dict) -> dict:
        return {**self._chunk({}, None), "choices": [], "usage": usage}


def create_app(lm, config: BrainConfig, settings: ServerSettings) -> FastAPI:
    """The ASGI app serving `lm` (a LoadedModel) with the brain settings `config`."""
    server = BrainServer(lm, config, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        try:
            yield
        finally:
            await server.close()

    app = FastAPI(title="Positronic Brain", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.error("request failed", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, await read_body(request, CompletionBody), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, await read_body(request, ChatBody), chat=True)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != lm.name:
            raise APIError(404, f"the model {model_id!r} does not exist here", param="model", code="model_not_found")
        return server.model_card()

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: str):
        try:
            check_session_id(session_id)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_session_id") from None
        try:
            state = await server.pool.describe(session_id)
        except SessionUnusable as exc:
            raise APIError(409, str(exc), code="session_unusable") from None
        if state is None:
            raise APIError(404, f"no session {session_id!r}", code="session_not_found")
        return {"id": session_id, "object": "session", **state}

    @app.get("/health")
    async def health():
        return server.health()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=server.metrics)
    return app


def serve_forever(lm, config: BrainConfig, settings: ServerSettings, *, host: str = "127.0.0.1",
                  port: int = 8080) -> None:
    """Run the server until Ctrl-C or SIGTERM; sessions are checkpointed on the way out."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    print(f"serving {lm.name} (policy {config.policy}, budget {config.budget}, at most {settings.max_sessions} "
          f"sessions in memory; checkpoints in {settings.session_dir})", flush=True)
    uvicorn.run(create_app(lm, config, settings), host=host, port=port, timeout_graceful_shutdown=10,
                log_level="info")
