"""An OpenAI-compatible HTTP server over the brain (`positronic serve`).

    POST /v1/completions        text in, text out; "stream": true for server-sent events;
                                logprobs and echo (logprobs.py)
    POST /v1/chat/completions   messages in, the assistant's reply out (the model's chat template)
    GET  /v1/models             the one model served (with max_model_len: the context budget)
    GET  /v1/sessions/{id}      a session's counts, transcript and live text (an extension)
    POST /tokenize              a prompt or chat as the ids a fresh session prefills (tokens.py)
    POST /detokenize            ids back to text
    GET  /health                liveness, sessions, requests in flight
    GET  /metrics               Prometheus text (positronic/server/metrics.py)

With an API key (`serve --api-key`, or $POSITRONIC_API_KEY) every request but GET /health needs
`Authorization: Bearer KEY`, else 401 before anything else runs (ApiKey); CORS headers are sent
only for the origins given with --cors-origin.

Each conversation is a brain of its own (positronic/server/conversation.py): the session id is the
request's `user` field or its `X-Session-Id` header (1-64 of A-Z a-z 0-9 _ -); a request with
neither gets a fresh brain that is thrown away after it. A session's first request prefills its
prompt (pruned to the budget by the policy if longer); each later one appends only its new part to the live brain: for a
chat, the messages after the last assistant message (user messages: earlier ones are the
session's own memory and are not read again), for a completion, its prompt text, at most a
turn's limit (the budget less the protected rows, chat.turn_limit). Generation goes on inside
the budget as in a run: the policy evicts, repairs, recalls; replies end at max_tokens, the
end-of-sequence token (unless `ignore_eos`, as in vLLM and llama.cpp) or a stop string.
`temperature` and `top_p` apply to the request's own tokens; `seed` to a brain the request
creates.
Every answer is written through to its session's checkpoint before its last byte, and a request
sent again with the same Idempotency-Key header is answered exactly once (answers.py).

Bad requests get a 4xx JSON body in OpenAI's error shape, {"error": {"message", "type",
"param", "code"}}: bad JSON or fields (400), an unknown model (404), a prompt past the
model's positions or a turn over its limit (400, context_length_exceeded), a bad session id (400), a body over --max-body
(413), more than --max-pending requests or every session slot busy (429), a checkpoint that
cannot be resumed (409); the server's own trouble is a 5xx in the same shape: shutting down (503),
no slot freeable because idle sessions cannot be checkpointed (507). A client that disconnects
stops its request's generation (one that leaves before its body is complete: one log line, 499).
Tokenizing runs in the server's text thread (BrainServer.off_loop), never on the event loop. A
shutdown (GracefulServer) cuts streams at their next token with a final error event, lets whole
replies finish within the graceful period (a second Ctrl-C ends the wait), and checkpoints only
what clients received.

The parts: the request bodies and the error shape (schemas.py), the checks beyond them
(rules.py), the server put together and a request's course (service.py: BrainServer), a
request's input made ready (prepare.py), the model worker and its forward thread (worker.py), a
session's conversation (conversation.py), one request's turn (turn.py), the sessions in memory
(pool.py), the reply built (replies.py) and written whole or as server-sent events
(streaming.py), several choices (choices.py), retried requests (answers.py), a chat's history
(history.py), log-probabilities (logprobs.py), chat text and stop strings (text.py), metrics
(metrics.py), the tokenizer endpoints (tokens.py). docs/batching.md ("In the server") walks one
request through them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import signal
import sys
import time
from collections.abc import Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..brain.loop import BrainConfig
from . import tokens
from .metrics import Metrics
from .schemas import APIError, ChatBody, CompletionBody, read_body
from .pool import SessionUnusable
from .rules import check_session_id
from .service import BrainServer, ServerSettings

log = logging.getLogger("positronic.server.app")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
             "/metrics")
GRACEFUL_S = 10  # seconds a shutdown waits for the requests in flight (uvicorn's timeout_graceful_shutdown)
STARTUP_FAILURE = 3  # uvicorn's exit status when the server cannot start


# -- middleware -------------------------------------------------------------------------------

def body_too_large(limit: int) -> APIError:
    """413 for a body over `limit` bytes (serve --max-body): the server's, and a cluster front's."""
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes (serve --max-body)",
                     code="request_too_large")


class BodyLimit:
    """Refuses a request body over `limit` bytes with 413: at once when its Content-Length
    says so, else when the bytes read pass it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = body_too_large(self.limit)
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

    def __init__(self, app, metrics: Metrics, server: BrainServer | None = None):
        self.app, self.metrics, self.server = app, metrics, server

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

        if self.server is not None:
            self.server.open_requests += 1  # until its last byte is sent: a shutdown waits for it
        try:
            await self.app(scope, receive, sending)
        finally:
            if self.server is not None:
                self.server.open_requests -= 1
            self.metrics.record_request(endpoint, status, time.perf_counter() - start)


class ApiKey:
    """Lets a request in only with `Authorization: Bearer KEY` (GET /health needs none); any
    other is answered 401 before the app sees it (`refused`). The key is never logged nor echoed."""

    def __init__(self, app, key: str):
        self.app = app
        # digests compared, not the keys: compare_digest's time then tells nothing of the key's length
        self.digest = hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (scope["method"] == "GET" and scope["path"] == "/health") or self.allows(scope):
            return await self.app(scope, receive, send)
        await self.refused()(scope, receive, send)

    @staticmethod
    def refused() -> Response:
        response = APIError(401, "a valid API key is required: send the header `Authorization: Bearer KEY`",
                            code="invalid_api_key").response()
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    def allows(self, scope) -> bool:
        scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(key.strip()).digest(), self.digest)


def create_app(lm, config: BrainConfig, settings: ServerSettings, *, api_key: str | None = None,
               cors_origins: Sequence[str] = ()) -> FastAPI:
    """The ASGI app serving `lm` (a LoadedModel) with the brain settings `config`; with
    `api_key`, requests must carry it (ApiKey); `cors_origins` ("*": any) may call it from a
    browser (none: no CORS headers)."""
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

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect):
        # the client's doing, not the server's: one line, and counted as the other requests whose
        # client left (499), not as a 500 with its traceback
        log.info("a client disconnected before sending its whole request body (%s %s)", request.method,
                 request.url.path)
        return Response(status_code=499)

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
        if model_id not in server.names:
            raise APIError(404, f"the model {model_id!r} does not exist here", param="model", code="model_not_found")
        return server.model_card(model_id)

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

    # the ids and their JSON (a 1 MB prompt: a million ids) are made in the text thread, not on the loop
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request, tokens.TokenizeBody)
        return await server.off_loop(lambda: JSONResponse(tokens.tokenize(server, body)))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request, tokens.DetokenizeBody)
        return await server.off_loop(lambda: JSONResponse(tokens.detokenize(server, body)))

    @app.get("/health")
    async def health():
        return server.health()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text(), media_type=server.metrics.content_type)

    # the last added runs first: every request is counted; a browser's preflight needs no key,
    # and a 401 carries the CORS headers that let the page read it; then the key, then the body
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["X-Session-Id"])
    app.add_middleware(RequestMetrics, metrics=server.metrics, server=server)
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn that tells the app's BrainServer when its shutdown begins (before it waits for
    the requests in flight), so streams are cut cleanly and new requests refused at once
    (BrainServer.begin_shutdown); the rest of the shutdown is uvicorn's. A second Ctrl-C
    (uvicorn's force_exit) stops the wait: the requests in flight are cancelled as when the
    graceful period runs out, and the sessions are still checkpointed (uvicorn alone skips the
    app's shutdown then, and the app's close ran only as asyncio tore the loop down, with a
    traceback)."""

    async def shutdown(self, sockets=None) -> None:
        server = getattr(getattr(self.config.app, "state", None), "server", None)
        if isinstance(server, BrainServer):
            server.begin_shutdown()
        await super().shutdown(sockets)
        if self.force_exit and isinstance(server, BrainServer) and not server.closed:
            log.warning("a second Ctrl-C: the requests in flight are cut now (their sessions are not checkpointed "
                        "with them); the other sessions are checkpointed")
            tasks = list(self.server_state.tasks)
            for task in tasks:
                task.cancel(msg="a second Ctrl-C")
            if tasks:
                await asyncio.wait(tasks, timeout=GRACEFUL_S)
            await self.lifespan.shutdown()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        # uvicorn names its address at INFO only; above that it is said here, so that a server on
        # --port 0 can always be found (clients look for "running on http://…" on stderr)
        if self.started and not logging.getLogger("uvicorn.error").isEnabledFor(logging.INFO):
            host, port = self.config.host, self.servers[0].sockets[0].getsockname()[1]
            print(f"positronic serve running on http://{f'[{host}]' if ':' in host else host}:{port}",
                  file=sys.stderr, flush=True)


def serve_forever(lm, config: BrainConfig, settings: ServerSettings, *, host: str = "127.0.0.1", port: int = 8080,
                  api_key: str | None = None, cors_origins: Sequence[str] = (), log_level: str = "info") -> int:
    """Run the server until Ctrl-C or SIGTERM; sessions are checkpointed on the way out. The
    exit status: 0, or 1 when a session could not be checkpointed (lost) or the shutdown failed.
    `log_level` (critical, error, warning, info, debug) is uvicorn's and the positronic loggers'; other libraries
    log at INFO at most."""
    level = getattr(logging, log_level.upper())
    logging.basicConfig(level=max(level, logging.INFO), format="%(levelname)s:     %(message)s")
    logging.getLogger("positronic").setLevel(level)
    served = f" as {', '.join(settings.served_model_names)}" if settings.served_model_names else ""
    print(f"serving {lm.name}{served} (policy {config.policy}, budget {config.budget}, at most {settings.max_sessions} "
          f"sessions in memory; checkpoints in {settings.session_dir}"
          f"{'; an API key is required' if api_key is not None else ''})", flush=True)
    app = create_app(lm, config, settings, api_key=api_key, cors_origins=cors_origins)
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_S,
                                           log_level=log_level))
    # uvicorn re-raises the signal that stopped it once it has shut down (SIGTERM then kills the
    # process): caught here for a moment, so that lost sessions can still decide the exit status
    terminated: list[int] = []

    def on_sigterm(sig, frame):  # uvicorn's own handler replaces this one while it runs
        terminated.append(sig)
        server.should_exit = True  # a SIGTERM before uvicorn took over: it stops as soon as it starts

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C, re-raised the same way: a stop like any other (as uvicorn.run has it)
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:
        return STARTUP_FAILURE  # uvicorn said why (the port taken, ...)
    if status := exit_status(app.state.server):
        return status
    if terminated:  # a clean stop by SIGTERM ends as one, as it did before
        signal.raise_signal(signal.SIGTERM)
    return 0


def exit_status(server: BrainServer) -> int:
    """0 after a clean shutdown; 1, with a line on stderr, if sessions were lost or the shutdown
    did not finish."""
    if server.lost:
        print(f"error: {len(server.lost)} sessions could not be checkpointed to {server.settings.session_dir} and "
              f"are lost: {', '.join(sorted(server.lost))}", file=sys.stderr, flush=True)
        return 1
    if not server.closed:
        print("error: the server did not shut down cleanly (its sessions may not be checkpointed)", file=sys.stderr,
              flush=True)
        return 1
    return 0
