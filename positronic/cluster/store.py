"""Sessions in an object store (`--session-store s3://…`, `gs://…`, `file://…`: any fsspec URL),
each replica working on a local copy.

A replica's server reads and writes sessions as files in its own local directory, as the plain
server does; this module moves them between that directory and the store (`SessionStore`) and
keeps one replica per session by a lease in the store (`ID/.lease`: the holder and when it
expires). `StoreSync` is the ASGI layer that does it around the replica's app:

- a request for a session the replica does not hold claims the session's lease (409
  `session_in_use` naming the holder if another replica's lease is live) and pulls its checkpoint
  from the store into the local directory, where the server resumes it as from any checkpoint;
- the server writes each answer's checkpoint locally before the answer's last byte; that last
  piece (a whole reply's body, or a stream's `data: [DONE]`) is held until the checkpoint is
  pushed to the store: the content-named files first (`kv-*.safetensors`, `blob-*.bin`, never
  rewritten), then `mirror.msgpack`, which names them, in one write; then the store's files it no
  longer names go. So the store, like a directory, always holds a whole checkpoint;
- every few seconds the leases of the sessions in memory are renewed, and those the server has
  freed (room, idle, shutdown) are pushed a last time and released.

A replica that dies stops renewing: its leases expire after `lease_s`. The front, which saw it
die, tells the session's next replica which replicas it sees dead (`X-Positronic-Takeover`: their
names), and a lease of theirs is taken over at once, so failover does not wait for the expiry.

Object stores have no atomic create-if-absent across every backend that fsspec reaches: a lease is
written, then read back, and the claim stands only if it reads back as this replica's. Two claims
racing within one round trip of each other could both read their own write on a store without
read-after-write consistency; the front sends a session to one replica at a time, so such races
need a front that restarted at that very moment.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Collection

from ..server.schemas import APIError
from .routes import session_of

log = logging.getLogger("positronic.cluster.store")

MIRROR = "mirror.msgpack"
LEASE = ".lease"
LOCAL_ONLY = {".lock", LEASE}  # the plain server's flock file stays on the replica's disk
TAKEOVER_HEADER = "x-positronic-takeover"  # the replicas the front saw die, by name, comma-separated


class Held(Exception):
    """The session's lease is another replica's and live."""

    def __init__(self, session: str, holder: str, left_s: float):
        super().__init__(f"session {session} is in use by {holder} (its lease runs {left_s:.0f} s more)")
        self.holder = holder


class SessionStore:
    """One session directory per session id under the URL's root (see the module's text)."""

    def __init__(self, url: str, local: Path, holder: str, lease_s: float = 30.0):
        import fsspec

        self.url, self.local, self.holder, self.lease_s = url, Path(local), holder, lease_s
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")
        self.fs.makedirs(self.root, exist_ok=True)

    def _remote(self, session: str, name: str = "") -> str:
        return f"{self.root}/{session}" + (f"/{name}" if name else "")

    def _names(self, session: str) -> set[str]:
        try:
            return {entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self._remote(session), detail=False)}
        except FileNotFoundError:
            return set()

    def _write(self, path: str, data: bytes) -> None:
        """`data` at `path` in one piece: written aside, then moved (a rename on a disk; on an
        object store the move is a copy, which lands whole)."""
        aside = f"{path}.{self.holder.replace(':', '-')}.tmp"
        self.fs.pipe_file(aside, data)
        self.fs.mv(aside, path)

    # -- the lease -----------------------------------------------------------------------------

    def lease(self, session: str) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self._remote(session, LEASE)))
        except FileNotFoundError:
            return None
        except ValueError:  # a torn or foreign file: nobody's lease
            return None

    def claim(self, session: str, takeover: Collection[str] = ()) -> None:
        """This replica's lease on `session`, or Held. `takeover`: the replicas seen dead (by
        name), whose leases may be taken before they expire."""
        now = time.time()
        current = self.lease(session)
        if current is not None and current.get("holder") != self.holder and current.get("expires", 0) > now:
            name = str(current.get("holder", "")).split(":")[0]
            # a lease of this replica's own name is its previous process's (Ray runs one at a time and
            # started this one when that one died): taken at once, as one the front saw die
            if name != self.holder.split(":")[0] and name not in takeover:
                raise Held(session, current.get("holder", "?"), current["expires"] - now)
            log.warning("session %s: taking the lease of %s, which is dead", session, current.get("holder"))
        self.fs.makedirs(self._remote(session), exist_ok=True)
        self._write(self._remote(session, LEASE), json.dumps({"holder": self.holder, "expires": now + self.lease_s}).encode())
        if (read := self.lease(session)) is None or read.get("holder") != self.holder:
            raise Held(session, (read or {}).get("holder", "?"), self.lease_s)

    def renew(self, session: str) -> None:
        self._write(self._remote(session, LEASE),
                    json.dumps({"holder": self.holder, "expires": time.time() + self.lease_s}).encode())

    def release(self, session: str) -> None:
        current = self.lease(session)
        if current is not None and current.get("holder") == self.holder:
            self.fs.rm_file(self._remote(session, LEASE))

    # -- the checkpoint ------------------------------------------------------------------------

    def pull(self, session: str) -> None:
        """The store's checkpoint of `session` into the local directory (which it replaces); none
        in the store: the local directory is emptied (a new session)."""
        local = self.local / session
        names = self._names(session) - LOCAL_ONLY
        if MIRROR not in names:
            for path in local.glob("*") if local.exists() else ():
                if path.name not in LOCAL_ONLY and path.is_file():
                    path.unlink()
            return
        local.mkdir(parents=True, exist_ok=True)
        mirror = self.fs.cat_file(self._remote(session, MIRROR))
        if (local / MIRROR).exists() and (local / MIRROR).read_bytes() == mirror:
            return  # this replica pushed it last: the local copy is the store's
        for name in sorted(names - {MIRROR}):
            if name.endswith(".tmp") or (local / name).exists():  # content-named: a file of that name is that content
                continue
            self.fs.get_file(self._remote(session, name), str(local / f"{name}.pulling"))
            (local / f"{name}.pulling").rename(local / name)
        (local / f"{MIRROR}.pulling").write_bytes(mirror)
        (local / f"{MIRROR}.pulling").rename(local / MIRROR)
        for path in local.glob("*"):
            if path.is_file() and path.name not in names | LOCAL_ONLY:
                path.unlink()

    def push(self, session: str) -> bool:
        """The local checkpoint of `session` into the store; False if there is none yet."""
        local = self.local / session
        if not (local / MIRROR).exists():
            return False
        present = self._names(session)
        if not present:
            self.fs.makedirs(self._remote(session), exist_ok=True)  # a disk needs the directory; a bucket does not
        files = {path.name for path in local.glob("*") if path.is_file() and path.name not in LOCAL_ONLY
                 and not path.name.endswith((".tmp", ".pulling"))}
        for name in sorted(files - present - {MIRROR}):
            self.fs.put_file(str(local / name), self._remote(session, name))
        mirror = (local / MIRROR).read_bytes()
        if MIRROR not in present or self.fs.cat_file(self._remote(session, MIRROR)) != mirror:
            self._write(self._remote(session, MIRROR), mirror)
        for name in present - files - LOCAL_ONLY:
            if not name.endswith(".tmp"):
                self.fs.rm_file(self._remote(session, name))
        return True

    def forget(self, session: str) -> None:
        """The local copy of a session this replica no longer holds (the store has it)."""
        local = self.local / session
        if local.exists() and not (local / ".lock").exists():
            shutil.rmtree(local, ignore_errors=True)


class StoreSync:
    """The ASGI layer around a replica's app that keeps its sessions in the store (see the
    module's text). `server`: the app's BrainServer (its pool says which sessions are in memory)."""

    def __init__(self, app, store: SessionStore, server, every_s: float = 5.0, api_key: str | None = None):
        from ..server.app import ApiKey

        from prometheus_client import Counter

        self.app, self.store, self.server, self.every_s = app, store, server, every_s
        # beside the server's own metrics (its /metrics): a push that failed leaves the store one answer behind
        self.push_failures = Counter("positronic_session_store_push_failures",
                                     "Checkpoints that could not be pushed to the session store (the answer went; "
                                     "the store keeps the session's previous checkpoint)",
                                     registry=server.metrics.registry)
        # a request without the key touches no lease: it goes straight to the app, which answers 401
        self.key = ApiKey(app, api_key) if api_key is not None else None
        self.max_body = server.settings.max_body_bytes  # past it the app answers 413: read no further
        self.state = app.state  # as the app's: the uvicorn server finds its BrainServer there
        self.held: set[str] = set()  # sessions whose lease this replica holds
        self.locks: dict[str, asyncio.Lock] = {}
        self.keeper: asyncio.Task | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(scope, receive, send)
        if scope["type"] != "http" or (self.key is not None and not self.key.allows(scope)):
            return await self.app(scope, receive, send)
        # the session read here as the server reads it (not taken from a header: a client may call a
        # replica directly, and its request must meet the same lease)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()}
        body, more = b"", True
        while more and len(body) <= self.max_body:
            message = await receive()
            if message["type"] != "http.request":  # gone before its body came: the app hears it
                return await self.app(scope, _replay(message, receive), send)
            body += message.get("body", b"")
            more = message.get("more_body", False)
        receive = _replay({"type": "http.request", "body": body, "more_body": more}, receive)
        session = session_of(scope["path"], headers, body)
        if session is None:
            return await self.app(scope, receive, send)
        if self.keeper is None or self.keeper.done():
            self.keeper = asyncio.get_running_loop().create_task(self._keep())
        # held for the whole request (the server runs a session's requests one at a time anyway): the
        # keeper never releases a session between its pull and the server's resume of it
        async with self.locks.setdefault(session, asyncio.Lock()):
            await self._serve(session, headers, scope, receive, send)

    async def _serve(self, session: str, headers: dict, scope, receive, send) -> None:
        if session not in self.held:
            takeover = [name.strip() for name in headers.get(TAKEOVER_HEADER, "").split(",") if name.strip()]
            try:
                await asyncio.to_thread(self.store.claim, session, takeover)
                await asyncio.to_thread(self.store.pull, session)
            except Held as exc:
                return await APIError(409, str(exc), code="session_in_use").response()(scope, receive, send)
            except Exception as exc:  # noqa: BLE001 -- the store unreachable, a file unreadable: nothing changed
                log.error("session %s: cannot be brought from %s: %s", session, self.store.url, exc)
                return await APIError(503, f"the session store {self.store.url} cannot be reached for session "
                                           f"{session}: {type(exc).__name__}: {exc}", type="server_error",
                                      code="store_unavailable").response()(scope, receive, send)
            self.held.add(session)

        pushed = False

        async def sending(message) -> None:
            nonlocal pushed
            last = message["type"] == "http.response.body" and (
                not message.get("more_body") or b"data: [DONE]" in message.get("body", b""))
            if last and not pushed:  # the answer's last piece waits for its checkpoint to be in the store
                pushed = True
                await self._push(session)
            await send(message)

        await self.app(scope, receive, sending)

    async def _push(self, session: str) -> None:
        try:
            await asyncio.to_thread(self.store.push, session)
        except Exception as exc:  # noqa: BLE001 -- the answer still goes; said and counted
            self.push_failures.inc()
            log.error("session %s: its checkpoint could not be pushed to %s: %s", session, self.store.url, exc)

    async def _keep(self) -> None:
        """Renews the leases of the sessions in memory; pushes and releases those freed."""
        while True:
            await asyncio.sleep(self.every_s)
            await self.settle()

    async def settle(self) -> None:
        loaded = set(self.server.pool.loaded)
        for session in sorted(self.held):
            lock = self.locks.setdefault(session, asyncio.Lock())
            if session in loaded or lock.locked():  # in memory, or a request under way: still this replica's
                try:
                    await asyncio.to_thread(self.store.renew, session)
                except Exception as exc:  # noqa: BLE001 -- tried again next time
                    log.error("session %s: its lease in %s could not be renewed: %s", session, self.store.url, exc)
                continue
            async with lock:
                try:
                    await self._push(session)
                    await asyncio.to_thread(self.store.release, session)
                    await asyncio.to_thread(self.store.forget, session)
                    self.held.discard(session)
                except Exception as exc:  # noqa: BLE001 -- tried again next time
                    log.error("session %s: its lease in %s could not be kept: %s", session, self.store.url, exc)

    async def _lifespan(self, scope, receive, send) -> None:
        """The app's own start-up and shutdown; after its shutdown (every session checkpointed
        locally), every session is pushed and released."""
        async def sending(message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                if self.keeper is not None:
                    self.keeper.cancel()
                for session in sorted(self.held):
                    await self._push(session)
                    try:
                        await asyncio.to_thread(self.store.release, session)
                    except Exception as exc:  # noqa: BLE001
                        log.error("session %s: its lease could not be released: %s", session, exc)
                self.held.clear()
            await send(message)

        await self.app(scope, receive, sending)


def _replay(first: dict, receive):
    """`receive` with `first` given back before the rest: the body read here, for the app to read."""
    given = False

    async def replayed() -> dict:
        nonlocal given
        if not given:
            given = True
            return first
        return await receive()

    return replayed
