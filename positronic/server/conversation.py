"""A session's conversation: what one session holds, and the brain calls its requests make.

A Conversation is one session's Brain (None until its first request), the forced tokens it
still has to read, its keyed answers (answers.py) and chat history (history.py), and what the
pool and the requests need to share it safely:

- `lock` (an asyncio lock, on the event loop): held by a request from its first token read to
  its last token generated (SessionPool.acquire, release), or by an eviction while its
  checkpoint is written, so two requests of one session never interleave;
- `stepping` (a WorkLock, in the forward thread): held through each tick, so a reader in
  another job (GET /v1/sessions/ID: `between_ticks`) gets in between two ticks of a request;
- `claim`: its directory (brain/session.py Claim), held while it is in the pool;
- `save`: its checkpoint, the file written in a helper thread (`batch.offload`).

The methods that touch the brain (`start`, `read_one`, `settle`, `step`, `save`, `describe`,
`between_ticks`) run on the model worker (worker.py), never on the event loop. `queue` runs
where a request prepares its input (prepare.py: on the event loop, or in the text thread for a
chat's turns), while the request holds the lock and no job of the session is running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from ..brain import session as sessions
from ..batch import WorkLock, offload, rounds
from ..batch.engine import Engine
from ..batch.seats import Seats
from ..brain.loop import Brain, BrainConfig, TickRecord
from .answers import Answers
from .history import History
from ..state.manager import StateBrokenError
from ..state.readonly import MirrorView

TRANSCRIPT_SOURCES = ("prompt", "user", "generated")  # what was said; repairs and insertions are the brain's own


def evicts_nothing(config: BrainConfig) -> bool:
    """Whether a brain under `config` never makes room (policy none with at_capacity stop): its
    live length only grows, so the server admits no input it has no room for."""
    return config.policy == "none" and config.at_capacity == "stop"


@dataclasses.dataclass(frozen=True)
class Ticks:
    """A turn's two kinds of tick (`Conversation.decoding`): `read()` adds the next queued input
    token (None when none is left), `generate()` draws one."""

    read: Callable[[], TickRecord | None]
    generate: Callable[[], TickRecord]


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
        self.seat: tuple[Engine, object] | None = None  # (engine, key) while its reply ticks in an engine's rounds

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

    @contextlib.contextmanager
    def decoding(self, engine: Engine | None, sampling: dict) -> Iterator[Ticks]:
        """A turn's ticks (`Ticks`): `read()` adds the next queued input token (`read_one`),
        `generate()` one token drawn with `sampling` in place of the session's own settings
        (`step`). With `engine` (ModelWorker.engine_for) the brain joins it and each tick is
        its part of the engine's next round, shared with every other session's there; on the
        way out it is handed back, its state, tick, sampler and policy as if it had made the
        ticks itself (Engine.hand_back). While it is in the engine, `describe` and
        `last_token` read the engine's record of it."""
        if engine is None:
            yield Ticks(self.read_one, functools.partial(self.step, sampling))
            return
        brain, key = self.brain, ("conversation", id(self))
        engine.join(key, brain, config=dataclasses.replace(brain.config, **sampling) if sampling else None)
        self.seat = (engine, key)
        try:
            yield Ticks(functools.partial(self._read_round, engine, key), functools.partial(self._round, engine, key))
        finally:
            self.seat = None
            try:
                engine.hand_back(key, brain)
            except Exception:  # its rows could not come back: the engine lets it go, the session is not trusted
                if key in engine.keys():
                    engine.leave(key)
                self.broken = True
                raise

    def _read_round(self, engine: Engine, key) -> TickRecord | None:
        """`read_one` in the engine's next round: the next forced token (source "generated"),
        else the next typed one ("user"), given to the round instead of a draw."""
        if not self.reading:
            return None
        given = (self.forced[0], "generated") if self.forced else (self.brain.pending_input[0], "user")
        record = self._round(engine, key, given)
        if not record.rebuilt:
            if self.forced:
                self.forced.popleft()
            else:
                self.brain.input_added()
        return record

    def _round(self, engine: Engine, key, given: tuple[int, str] | None = None) -> TickRecord:
        """One token in the engine's next round (`decoding`), drawn or `given` (token id,
        ledger source), recorded as a tick."""
        start = time.perf_counter()
        self.dirty = True
        with self.stepping:
            token = rounds.tick(engine, key, given)
        record = Seats.record(engine, key, token, source="generated" if given is None else given[1])
        self.on_tick(record, time.perf_counter() - start)
        return record

    def next_logits(self):
        """The logits the next generated token is drawn from ([vocab] float32, a copy in an engine)."""
        if self.seat is not None:
            engine, key = self.seat
            return engine.state.next_logits[engine.keys().index(key)].clone()
        return self.brain.state.next_logits

    def _tick(self, force: int | None, *, forced: bool = False) -> TickRecord:
        config = self.brain.config
        if evicts_nothing(config) and self.brain.state.rows_per_layer >= config.budget:
            # the server admits no more than fits (rules.check_room): never a tick past the budget
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
        if self.seat is not None:
            engine, key = self.seat
            slot = engine.keys().index(key)
            return int(engine.state.token_ids[slot, 0, int(engine.state.length[slot]) - 1])
        return self.brain.state.live_token_ids()[-1]

    def between_ticks(self, fn: Callable[[], object]):
        """On the model worker, in a job of its own while the session's request ticks in
        another: `fn()` between two of its ticks (the tick in progress ends first, and the
        next one waits for `fn`)."""
        with self.stepping:
            return fn()

    def describe(self) -> dict:
        """The session's state for clients: counts, and its text (transcript and live)."""
        if self.seat is not None:  # its reply ticks in an engine: the engine's mirror of it is the truth
            engine, key = self.seat
            slot = engine.keys().index(key)
            return describe(engine.state.mirror(slot), engine.state.tick(slot), self.brain.config.budget)
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
