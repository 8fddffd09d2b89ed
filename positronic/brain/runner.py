"""One invocation of the brain: ticks, the event log, checkpoints, memory samples, Ctrl-C.

Both views (plain progress and the live terminal view) drive a run through `Runner.run`,
passing a callback that sees every TickRecord; the bookkeeping lives only here.

Ctrl-C (SIGINT) and SIGTERM are requests to stop: the tick under way finishes, its event is
written, the session is saved, and the run ends. An interrupt never lands inside a tick, so
the saved state, the event log and the summary always agree on the last tick.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from positronic import mirror

from . import session as sessions
from .chat import END_OF_INPUT, TurnRefused
from .dialogue import Dialogue
from .loop import Brain, TickRecord

RUN = "run"  # the run's one sequence, in its `rounds`
RSS_SAMPLES = (1000, 10000)  # ticks at which resident memory is recorded


def rss_mb() -> float:
    """Resident memory of this process in MiB (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class RunResult:
    ticks: int = 0  # ticks run by this invocation
    seconds: float = 0.0
    interrupted: bool = False
    signal: int | None = None  # the signal that ended the run (SIGINT, SIGTERM), if one did
    stopped: bool = False  # the policy ended the run
    complete: bool = False  # the run's grammar was whole (run --grammar): nothing could follow
    saved_to: Path | None = None
    rss_mb: dict[int, float] = field(default_factory=dict)  # ticks run -> RSS


EVENTS_SCHEMA = 1  # docs/events.md; raised when a field changes meaning or goes away


def event_header(brain: Brain, model_name: str, *, resumed: bool) -> dict:
    """The record that opens each invocation's part of an event log: what produced the tick
    records after it (their `tick` counts on from this record's)."""
    return {"record": "header", "schema": EVENTS_SCHEMA, "tick": brain.tick, "resumed": resumed,
            "run_id": brain.run_id, "model": model_name, "config": dataclasses.asdict(brain.config),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def events_run_id(path: Path) -> str | None:
    """The run id in the header that opens the event log at `path`, or None when its first line
    is not such a header (another file, a log from before run ids, an empty file)."""
    try:
        with open(path, "rb") as file:
            first = file.readline(1 << 16)
        record = json.loads(first)
    except (OSError, ValueError):
        return None
    if isinstance(record, dict) and record.get("record") == "header" and isinstance(record.get("run_id"), str):
        return record["run_id"]
    return None


def trim_events(path: Path, tick: int) -> None:
    """Drop the records after `tick` (a resumed run goes on from its checkpoint: the ticks the
    stopped run made after it will be made again, and a header written after it belongs to an
    invocation whose ticks are dropped) and a torn last line; atomic rewrite."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut off when the run was killed
        if isinstance(record, dict) and isinstance(record.get("tick"), int) and record["tick"] <= tick:
            kept.append(line)
    mirror.write_atomic(path, "".join(line + "\n" for line in kept).encode("utf-8"))


class StopRequests:
    """While active (in the main thread), SIGINT and SIGTERM only set `signal`; the run looks
    at it between ticks. The previous handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._request)
        return self

    def _request(self, number, frame) -> None:
        self.signal = number

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


class Runner:
    """`inputs`: lines typed while the run goes on (put there by another thread: stdin, the
    live view's input line); they are taken between ticks, in the run's thread, and queued as
    user turns (Brain.say). A line refused (too long) is passed to `on_refused` as a message."""

    def __init__(self, brain: Brain, model_name: str, ticks: int | None, *, events: Path | None = None,
                 append_events: bool = False, session: Path | None = None, save_every: int = 100,
                 inputs: queue.SimpleQueue | None = None, on_refused: Callable[[str], None] | None = None,
                 dialogue: Dialogue | None = None, rounds=None):
        self.brain, self.model_name, self.ticks = brain, model_name, ticks
        # rounds: an empty positronic.batch.Batch (compiled, one slot) whose engine rounds make the
        # ticks (docs/core.md, "A lone stream"); the brain is handed back whenever something
        # reads it (`sync`: a save, a frame of the live view, the end)
        self.batch = rounds
        self.in_rounds = False  # the last tick was an engine round: no Observer saw it, its record says what it did
        if rounds is not None:
            rounds.join(RUN, brain)
        self.dialogue = dialogue  # conversation mode: its turns instead of `inputs` (dialogue.py)
        self.events, self.append_events = events, append_events
        self.session, self.save_every = session, save_every
        self.inputs = inputs
        self.on_refused = on_refused or (lambda message: print(message, file=sys.stderr, flush=True))

    def refusal(self) -> str | None:
        """Why the brain's ticks cannot be compiled rounds (they would be its own), or None."""
        return None if self.batch is None else self.batch.seats.refusal(self.brain)

    def warm(self) -> int:
        """Compile the rounds now, before the first tick (about 40 s for SmolLM2 on a 2-core
        CPU, seconds for random:tiny; the graphs are kept for the process). Returns the graphs made."""
        return 0 if self.batch is None else self.batch.warm()

    def sync(self) -> Brain:
        """The brain, up to date (its rows, ledger, counts, policy): a brain whose ticks are
        rounds is handed back (a copy of its rows, ~25 ms for SmolLM2) and sits again at its next tick."""
        if self.batch is not None:
            self.batch.stand()
        return self.brain

    def _tick(self, force: int | None) -> TickRecord:
        if self.batch is None:
            return self.brain.step(force)
        record = self.batch.step(None if force is None else {RUN: force})[RUN]
        self.in_rounds = RUN in self.batch.seated
        if isinstance(record, BaseException):  # what the brain's own tick would have raised
            raise record
        return record

    def take_input(self) -> None:
        """Queue every line typed since the last call as a user turn (never waits)."""
        while self.inputs is not None:
            try:
                line = self.inputs.get_nowait()
            except queue.Empty:
                return
            if line is END_OF_INPUT:  # a story run goes on after its input ends
                continue
            try:
                self.brain.say(line)
            except TurnRefused as exc:
                self.on_refused(str(exc))

    def run(self, on_tick: Callable[[TickRecord, RunResult], None]) -> RunResult:
        """Run the ticks; Ctrl-C or SIGTERM end the run cleanly after the tick under way (the
        session is saved either way, unless the state is broken: that is never saved)."""
        with StopRequests() as stops:
            return self._run(on_tick, stops)

    def _run(self, on_tick, stops: StopRequests) -> RunResult:
        result, brain = RunResult(), self.brain
        if self.events:
            self.events.parent.mkdir(parents=True, exist_ok=True)  # checked writable before the model loaded
        if self.events and self.append_events:
            trim_events(self.events, brain.tick)
        # line-buffered, so `tail -f` shows every tick as it happens
        log = open(self.events, "a" if self.append_events else "w", encoding="utf-8", buffering=1) if self.events else None
        if log:
            log.write(json.dumps(event_header(brain, self.model_name, resumed=self.append_events)) + "\n")
        start = time.perf_counter()
        try:
            for done in itertools.count(1) if self.ticks is None else range(1, self.ticks + 1):  # None: no limit
                if stops.signal is not None:
                    break
                force = None
                if self.dialogue is not None:  # the reply's closing, or a wait for the next line
                    going, force = self.dialogue.before_tick(brain, lambda: stops.signal is not None)
                    if not going:
                        break
                else:
                    self.take_input()
                record = self._tick(force)
                if self.dialogue is not None:
                    self.dialogue.after_tick(record)
                result.ticks, result.seconds = done, time.perf_counter() - start
                if log:
                    log.write(json.dumps(record.to_json()) + "\n")
                if self.session and record.tick % self.save_every == 0:
                    sessions.save(self.session, self.sync(), self.model_name)
                if done in RSS_SAMPLES:
                    result.rss_mb[done] = rss_mb()
                on_tick(record, result)
                if record.stopped:
                    result.stopped = True
                    break
                if record.complete and self.dialogue is None:  # the run's grammar is whole: nothing may follow
                    result.complete = True
                    break
        except KeyboardInterrupt:  # outside the main thread signals cannot be deferred
            result.interrupted, result.signal = True, signal.SIGINT
        finally:
            result.seconds = time.perf_counter() - start
            if log:
                log.close()
            self.sync()
            if self.session and not brain.state.broken:
                if self.dialogue is None:
                    self.take_input()  # a line typed during the last tick is saved, fed on resume
                result.saved_to = sessions.save(self.session, brain, self.model_name)
        if stops.signal is not None:
            result.interrupted, result.signal = True, stops.signal
        return result


def summary(brain: Brain, lm, result: RunResult) -> str:
    """The closing lines of a run, in words."""
    c, ledger = brain.counts, brain.state.mirror.ledger
    lines = [
        "--- summary ---" + (" (interrupted)" if result.interrupted else "") + (" (policy stopped)" if result.stopped else "")
        + (" (grammar complete)" if result.complete else ""),
        f"model {lm.name} on {lm.device} ({str(lm.dtype).removeprefix('torch.')}), "
        f"policy {brain.config.policy}",
        f"ticks {result.ticks} in {result.seconds:.1f} s ({result.ticks / max(result.seconds, 1e-9):.2f} tok/s); "
        f"now at tick {brain.tick}",
        f"live {brain.state.rows_per_layer} / budget {brain.config.budget}"
        + (f" per layer ({len(brain.state)} tokens in some layer)" if brain.state.per_layer else "")
        + f"; ledger {len(ledger)} tokens "
        f"({ledger.count('culled')} culled, {ledger.count('replaced')} replaced)",
        f"repairs {c['repairs']}  culls {c['culls']}  rebuilds {c['rebuilds']}  refreshes {c['refreshes']}",
        f"cache {brain.state.cache.memory_usage_mb():.1f} MiB ({brain.state.kv_format}, "
        f"{brain.state.bytes_per_token()} B/token)  RSS {rss_mb():.0f} MiB"
        + "".join(f"  (RSS after {k} ticks: {v:.0f} MiB)" for k, v in result.rss_mb.items()),
    ]
    if result.saved_to:
        lines.append(f"session saved: {result.saved_to} (tick {brain.tick})")
    return "\n".join(lines)
