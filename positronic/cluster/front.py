"""The front: the one OpenAI-compatible endpoint of a cluster (Ray Serve's HTTP proxy on
`--host`/`--port`) that sends every request to its session's replica (routes.py) and relays the
answer byte for byte as the replica writes it, streams included.

What a client sees is the plain server's answer, plus an `X-Positronic-Replica` header naming
the replica that made it. When a replica dies:
- a request that never reached it (the connection refused) goes to the session's next replica at
  once; so does one that reached it but got no answer, when it carries an Idempotency-Key (the
  server answers a key exactly once); without a key it is answered 502 `replica_failed`, since
  the turn may or may not be in the session's checkpoint;
- an answer cut off half-way is cut off for the client too (the stream ends without `[DONE]`, a
  whole reply short of its length), as a dying plain server's would be: the client asks again
  with its Idempotency-Key, and the session's next replica answers it from the store.
A session's request tells the replica which replicas the front saw die (`X-Positronic-Takeover`):
a lease of theirs is taken over at once (store.py). A replica that answers 409 `session_in_use`
does not hold the session (another replica does, after a front restarted and forgot where
sessions moved): the next one is tried, and the one that answers keeps the session.
"""


import asyncio
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve

from ..server.app import ApiKey, body_too_large
from ..server.schemas import APIError
from .routes import NoReplica, Routes, session_of
from .store import TAKEOVER_HEADER

log = logging.getLogger("positronic.cluster.front")

REPLICA_HEADER = "X-Positronic-Replica"
# not passed on: the connection's own headers (each hop has its own), and the length httpx sets again
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host",
                         "content-length", "proxy-connection"})
WATCH_EVERY_S = 1.0  # how often replicas marked down are asked whether they are back
ASK_TIMEOUT_S = 5.0  # a replica's url or health: one that does not answer in this time is still down

app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(APIError)
async def api_error(request: Request, exc: APIError):
    return exc.response()


# no CPU of its own asked for (as Ray's proxy asks none): it relays, and a replica's CPUs are the ones that count
@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Front:
    """Routes and relays (see the module's text). `replicas`: each replica's deployment handle by name."""

    def __init__(self, replicas: dict, max_body: int, api_key: str | None = None):
        self.handles = replicas
        # the plain server's check (a digest compared in constant time), for the front's own endpoints
        self.key = ApiKey(None, api_key) if api_key is not None else None
        self.routes = Routes(list(replicas))
        self.urls: dict[str, str] = {}
        self.max_body = max_body
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=ASK_TIMEOUT_S),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.registry = CollectorRegistry()
        self.requests = Counter("positronic_cluster_requests", "Requests relayed, by replica and status",
                                ["replica", "status"], registry=self.registry)
        self.failures = Counter("positronic_cluster_replica_failures",
                                "Times a replica refused or broke a request and was marked down", ["replica"],
                                registry=self.registry)
        self.up_gauge = Gauge("positronic_cluster_replicas_up", "Replicas taking requests", registry=self.registry)
        self.watcher: asyncio.Task | None = None

    # -- the replicas --------------------------------------------------------------------------

    async def url(self, name: str) -> str | None:
        if name not in self.urls:
            try:
                self.urls[name] = await asyncio.wait_for(self._ask_url(name), ASK_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 -- starting, restarting or gone: down either way
                log.warning("replica %s has no address now (%s)", name, type(exc).__name__)
                return None
        return self.urls[name]

    async def _ask_url(self, name: str) -> str:
        return await self.handles[name].url.remote()

    async def _ask_pid(self, name: str) -> int:
        return await self.handles[name].pid.remote()

    def lost(self, name: str, why: str) -> None:
        if name not in self.routes.down:
            log.warning("replica %s is down (%s): its sessions go to the next replica from the store", name, why)
            self.failures.labels(name).inc()
        self.routes.fail(name)
        self.urls.pop(name, None)  # Ray restarts it elsewhere: ask its address again

    async def watch(self) -> None:
        """Brings replicas marked down back once they answer again (Ray restarts a dead one)."""
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            for name in list(self.routes.down):
                url = await self.url(name)
                if url is None:
                    continue
                try:
                    alive = (await self.client.get(f"{url}/health", timeout=ASK_TIMEOUT_S)).status_code == 200
                except httpx.HTTPError:
                    alive = False
                if alive:
                    log.warning("replica %s is back at %s", name, url)
                    self.routes.revive(name)
                else:
                    self.urls.pop(name, None)

    # -- the endpoints -------------------------------------------------------------------------

    @app.get("/health")
    async def health(self):
        """The front's replicas: each one's address, whether it takes requests, and its own /health."""
        self._start_watching()
        replicas = {}
        for name in self.routes.replicas:
            up = name not in self.routes.down
            # a replica marked down is not waited for here (the watcher asks it): /health answers at once
            url = await self.url(name) if up else self.urls.get(name)
            entry = {"url": url, "up": up}
            if url is not None and entry["up"]:
                try:
                    entry["health"] = (await self.client.get(f"{url}/health", timeout=ASK_TIMEOUT_S)).json()
                    entry["pid"] = await asyncio.wait_for(self._ask_pid(name), ASK_TIMEOUT_S)
                except (httpx.HTTPError, ValueError, asyncio.TimeoutError) as exc:
                    entry["health"] = {"status": f"unreachable ({type(exc).__name__})"}
                    if isinstance(exc, httpx.TransportError):  # gone (Ray is starting it again): down until it answers
                        self.lost(name, type(exc).__name__)
                        entry["up"] = False
            replicas[name] = entry
        up = [name for name, entry in replicas.items() if entry["up"]]
        return JSONResponse({"status": "ok" if up else "no replica up", "replicas": replicas,
                             "sessions_moved": self.routes.moved}, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics(self, request: Request):
        """The front's own counters (each replica's at /replicas/NAME/metrics, or its url's /metrics)."""
        if refused := self._refused(request):
            return refused
        self.up_gauge.set(len(self.routes.up()))
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/replicas/{name}/metrics")
    async def replica_metrics(self, name: str, request: Request):
        """A replica's own /metrics through the front (one address for Prometheus to scrape them all)."""
        if refused := self._refused(request):
            return refused
        if name not in self.handles:
            raise APIError(404, f"no replica {name!r} (the replicas: {', '.join(self.routes.replicas)})",
                           code="not_found")
        url = await self.url(name) if name not in self.routes.down else None
        try:
            if url is None:
                raise httpx.ConnectError("down")
            answer = await self.client.get(f"{url}/metrics", timeout=ASK_TIMEOUT_S,
                                           headers={k: v for k, v in request.headers.items() if k.lower() == "authorization"})
        except httpx.TransportError as exc:
            raise APIError(503, f"replica {name} is down ({type(exc).__name__})", type="server_error",
                           code="no_replica") from None
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type", CONTENT_TYPE_LATEST))

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(self, request: Request, path: str):
        self._start_watching()
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return self._too_large()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                return self._too_large()
        # a client's own X-Positronic-* headers are not passed on: only the front tells a replica those
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_HEADERS and not k.lower().startswith("x-positronic-")}
        session = session_of(request.url.path, {k.lower(): v for k, v in headers.items()}, bytes(body))
        # safe to send again to another replica: nothing changes on a GET, and a keyed request is
        # answered once whatever reached the replica before it died
        resendable = request.method in ("GET", "HEAD", "OPTIONS") or "idempotency-key" in request.headers
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        tried: set[str] = set()
        conflict: Response | None = None
        while True:
            try:
                name = self.routes.pick(session, tried)
            except NoReplica as exc:
                if conflict is not None:
                    return conflict
                return APIError(503, f"no replica can take this request: {exc}", type="server_error",
                                code="no_replica").response()
            tried.add(name)
            url = await self.url(name)
            if url is None:
                self.lost(name, "no address")
                continue
            # for a replica on an object store (store.py): the replicas seen dead, whose leases it may take
            # over at once rather than after they expire (which of them held the session, the store says)
            dead = self.routes.seen_dead(name) if session is not None else []
            told = {TAKEOVER_HEADER: ",".join(dead)} if dead else {}
            upstream_request = self.client.build_request(request.method, url + target, headers={**headers, **told},
                                                         content=bytes(body))
            try:
                upstream = await self.client.send(upstream_request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self.lost(name, type(exc).__name__)  # never reached it: safe to send on
                continue
            except httpx.TransportError as exc:
                self.lost(name, type(exc).__name__)
                if resendable:
                    continue
                self.requests.labels(name, "502").inc()
                return APIError(502, f"replica {name} stopped before answering ({type(exc).__name__}); the "
                                     f"session{f' {session}' if session else ''} goes on on another replica from "
                                     "its last checkpoint, which may or may not hold this request: send it with an "
                                     "Idempotency-Key to have it answered exactly once", type="server_error",
                                code="replica_failed").response()
            if upstream.status_code == 409 and session is not None:
                content = await upstream.aread()
                await upstream.aclose()
                answer = Response(content, status_code=409, headers=self._headers(upstream, name))
                if b"session_in_use" in content:  # held elsewhere (or by a run): try the others, else say so
                    conflict = conflict or answer
                    continue
                self.requests.labels(name, "409").inc()
                return answer
            if session is not None:
                self.routes.settle(session, name)
            self.requests.labels(name, str(upstream.status_code)).inc()
            return StreamingResponse(self._relay(upstream, name), status_code=upstream.status_code,
                                     headers=self._headers(upstream, name))

    # -- helpers -------------------------------------------------------------------------------

    async def _relay(self, upstream: httpx.Response, name: str):
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            # the replica died half-way: the client's answer is cut as a dying server's would be
            self.lost(name, f"{type(exc).__name__} mid-answer")
            raise
        finally:
            await upstream.aclose()

    @staticmethod
    def _headers(upstream: httpx.Response, name: str) -> dict[str, str]:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS - {"content-length"}}
        headers[REPLICA_HEADER] = name
        return headers

    def _refused(self, request: Request) -> Response | None:
        """401 unless the request carries the replicas' key (the front's own endpoints but /health;
        the rest the replicas check)."""
        return None if self.key is None or self.key.allows(request.scope) else self.key.refused()

    def _too_large(self) -> Response:
        return body_too_large(self.max_body).response()

    def _start_watching(self) -> None:
        if self.watcher is None or self.watcher.done():
            self.watcher = asyncio.get_running_loop().create_task(self.watch())
