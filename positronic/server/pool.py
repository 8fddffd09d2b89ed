"""The pool: the sessions resident in memory, at most `max_sessions`, the rest checkpointed.

    worker = ModelWorker()                      # every job that touches a brain runs there
    pool = SessionPool(lm, worker, directory, max_sessions=16)
    conversation = await pool.acquire("alice")  # in memory, resumed from disk, or new (brain None)
    ... Turn(conversation, worker, lm, max_tokens=64).pieces() ...
    pool.release(conversation)

Everything here runs on the event loop; what touches a brain (a resume, a checkpoint, a
describe) is a job of the model worker, awaited. A request holds its conversation (its asyncio
lock) from `acquire` to `release`; one admission (an eviction, a resume) runs at a time.

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
import logging
import time
from collections.abc import Callable
from pathlib import Path

from ..brain import session as sessions
from ..batch import offload
from ..brain.loop import Brain, TickRecord
from .answers import Answers
from .conversation import Conversation, describe
from .history import History
from ..state.readonly import MirrorView
from .worker import ModelWorker

log = logging.getLogger("positronic.server.app")

HOLDER = "positronic serve"  # how a session's lock file names the server holding it


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
