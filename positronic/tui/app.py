"""The live terminal view of a run (rich): the context coloured by brightness, the counters,
the brightness distribution, the last edits in words and a progress bar.

    run_live(brain, lm, runner, show_prompt=True)   # what `run.py` calls on a terminal

The view's parts:
    snapshot.py  what a frame shows, copied out of the brain in the loop thread
    style.py     colours (viridis, readable on any terminal) and the marks of a token
    render.py    the frame, drawn from a snapshot (pure: no terminal IO, no threads)
    records.py   each tick's edits in words (an Observer of the loop)
    terminal.py  keys, the input line, and the rich Live that redraws the latest frame
    app.py       the wiring: `loading`, and `run_live`

Threads: rich's `Live` redraws from its own thread (4 times a second) while the tick loop
mutates the mirror in the main thread. The render thread therefore never reads the brain:
`on_tick` copies what a frame needs into an immutable `Snapshot` of plain Python lists, at
most once per refresh interval, and every frame is built from the latest snapshot alone.
Typed lines go through the Runner's input queue, which the loop thread drains between ticks
(Brain.say): neither the key thread nor the render thread touches the brain.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections import deque
from typing import TYPE_CHECKING

from rich.console import Console
from rich.live import Live

from ..brain.runner import Runner, RunResult, summary
from .records import ActionRecorder
from .render import BOTTOM_ROWS
from .snapshot import Snapshot, take_snapshot
from .terminal import FrameLive, KeyReader, LiveView, edit_line

if TYPE_CHECKING:  # imported for annotations only: the loop module pulls in torch
    from ..brain.loop import Brain, TickRecord
    from ..models import LoadedModel

REFRESH_PER_SECOND = 4
# a frame of a run in compiled rounds hands the brain back and seats it again (~40 ms for SmolLM2
# on a 2-core CPU): at most two a second there
ROUNDS_SNAPSHOT_SECONDS = 0.5
RATE_WINDOW = 32  # ticks in the tokens/s moving average
NOTE_SECONDS = 10.0  # a refused line's message stays on the input line this long


@contextlib.contextmanager
def loading(model: str, console: Console | None = None, *, what: str | None = None):
    """A spinner line while the model loads and the prompt is prefilled (SmolLM2 takes ~6 s on
    a CPU, longer on its first run), or while `what` is done: without it the screen stays blank
    until the view opens. The line goes when the block ends, however it ends (Ctrl-C included)."""
    console = console or Console()
    with console.status(f"{what or f'loading {model}'} …", spinner="dots"):
        yield


def run_live(brain: "Brain", lm: "LoadedModel", runner: Runner, *, show_prompt: bool,
             console: Console | None = None, refresh_per_second: float = REFRESH_PER_SECOND,
             keys: int | None = None) -> RunResult:
    """Run `runner` under the live view, then print the summary below its last frame.

    Ctrl-C ends the run cleanly (Runner saves the session); the final frame stays on
    screen. `show_prompt` is False on a resumed run (the header says so). `keys`: a terminal
    to read typed lines from (the input line; they go into `runner.inputs`). A refused line
    is said on the input line and in the edits panel (not on stderr, under the view).
    Returns the RunResult.
    """
    console = console or Console()
    recorder = ActionRecorder(lm)
    brain.observers.append(recorder)
    interval = 1.0 / refresh_per_second if runner.batch is None else max(1.0 / refresh_per_second,
                                                                         ROUNDS_SNAPSHOT_SECONDS)
    stamps: deque[float] = deque(maxlen=RATE_WINDOW + 1)
    last = [0.0]  # time of the last snapshot
    note = ["", 0.0]  # the last refusal and when it came (the loop thread writes it)

    def snap(done: int, elapsed: float, status: str = "running") -> Snapshot:
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else (
            done / elapsed if elapsed > 0 else 0.0)
        return take_snapshot(runner.sync(), lm, done=done, total=runner.ticks, tok_s=rate, elapsed=elapsed,
                             actions=list(recorder.lines)[-BOTTOM_ROWS * 4:], status=status,
                             resumed=not show_prompt,
                             input_note=note[0] if time.perf_counter() - note[1] < NOTE_SECONDS else "")

    def refused(message: str) -> None:
        note[:] = message, time.perf_counter()
        recorder.lines.append(f"t{brain.tick} {message}")
        last[0] = 0.0  # the next tick shows it

    view = LiveView(snap(0, 0.0))
    runner.on_refused = refused
    if keys is not None and runner.inputs is None:
        runner.inputs = queue.SimpleQueue()

    def on_tick(record: "TickRecord", result: RunResult) -> None:
        now = time.perf_counter()
        stamps.append(now)
        # a snapshot costs a pass over the live rows: take one per refresh, not per tick
        if now - last[0] >= interval or record.stopped or result.ticks == runner.ticks:
            last[0] = now
            view.snapshot = snap(result.ticks, result.seconds)

    def on_key(live: Live):
        def edit(key: str) -> None:  # in the key thread: the line, and the queue the loop drains
            view.prompt, line = edit_line(view.prompt or "", key)
            if line is not None:
                runner.inputs.put(line)
            live.refresh()
        return edit

    try:
        with FrameLive(view, console=console, auto_refresh=True, refresh_per_second=refresh_per_second,
                       vertical_overflow="crop") as live:
            reader = contextlib.nullcontext() if keys is None else KeyReader(keys, on_key(live))
            try:
                with reader:
                    view.prompt = "" if getattr(reader, "active", False) else None
                    result = runner.run(on_tick)
            finally:
                view.prompt = None  # the run is over: no more input
            closing = summary(runner.sync(), lm, result)
            status = ("interrupted" if result.interrupted else "policy stopped" if result.stopped else "finished")
            view.snapshot = snap(result.ticks, result.seconds, status)
            view.reserve = closing.count("\n") + 1  # the last frame and the summary fit on one screen
            live.refresh()
    finally:
        brain.observers.remove(recorder)
    console.print(closing, markup=False, highlight=False)
    return result
