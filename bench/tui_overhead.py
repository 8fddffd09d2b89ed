"""How much the live terminal view slows the tick loop.

    python bench/tui_overhead.py                          # random:tiny and smollm2, 200 ticks, budget 64
    python bench/tui_overhead.py --models smollm2 --ticks 300 --repeats 3

Per model, the same run (same prompt, seed and budget) is timed with `run_plain` writing to
/dev/null and with `run_live` drawing into a 120×40 truecolor rich Console that writes to
memory (force_terminal, so Live does all its cursor work and its refresh thread runs).
Runs alternate plain/live so background load hits both alike; the table shows the median
tok/s of the loop (Runner's own clock: ticks and on_tick callbacks, not model loading),
live/plain, and "view CPU": the CPU time the view itself used (redraws on the render thread,
snapshots on the loop thread; thread_time) as a share of the run's wall time, a figure that
background load barely moves. Also printed: what one frame and one snapshot cost alone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402

from positronic.cli import DEFAULT_PROMPT, run_plain  # noqa: E402
from positronic.brain.loop import Brain, BrainConfig  # noqa: E402
from positronic.models import load_model  # noqa: E402
from positronic.brain.runner import Runner  # noqa: E402
from positronic.tui import app as tui  # noqa: E402
from positronic.tui.app import run_live, take_snapshot  # noqa: E402
from positronic.tui.render import frame  # noqa: E402


class TimedRunner(Runner):
    """A Runner that keeps its RunResult, so the loop's own tok/s can be read after a view ran."""

    def run(self, on_tick):
        self.result = super().run(on_tick)
        return self.result


def fresh(lm, ticks: int, budget: int) -> tuple[Brain, TimedRunner]:
    """A new brain on the default prompt and a runner for `ticks` ticks."""
    brain = Brain.start(lm, [lm.bos_id] + lm.encode(DEFAULT_PROMPT), BrainConfig(budget=budget, seed=0))
    return brain, TimedRunner(brain, lm.name, ticks)


def plain_tok_s(lm, ticks: int, budget: int) -> float:
    """tok/s of a run_plain run with its output thrown away."""
    brain, runner = fresh(lm, ticks, budget)
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        run_plain(brain, lm, runner, show_prompt=True)
    return runner.result.ticks / runner.result.seconds


class ViewClock:
    """CPU seconds the view spends, on any thread: redraws (render thread) and snapshots
    (loop thread). Installed by wrapping the two entry points for one run."""

    def __init__(self):
        self.seconds, self.redraws, self.snapshots = 0.0, 0, 0

    def __enter__(self):
        self.refresh, self.take = tui.FrameLive.refresh, tui.take_snapshot
        clock = self

        def refresh(live):
            start = time.thread_time()
            clock.refresh(live)
            clock.seconds += time.thread_time() - start
            clock.redraws += 1

        def take(*args, **kwargs):
            start = time.thread_time()
            snapshot = clock.take(*args, **kwargs)
            clock.seconds += time.thread_time() - start
            clock.snapshots += 1
            return snapshot

        tui.FrameLive.refresh, tui.take_snapshot = refresh, take
        return self

    def __exit__(self, *exc):
        tui.FrameLive.refresh, tui.take_snapshot = self.refresh, self.take


def live_tok_s(lm, ticks: int, budget: int) -> tuple[float, float]:
    """tok/s of a run_live run drawing a 120×40 truecolor terminal into memory, and the
    share of the run's wall time the view kept a CPU busy."""
    brain, runner = fresh(lm, ticks, budget)
    console = Console(file=io.StringIO(), force_terminal=True, width=120, height=40, color_system="truecolor")
    with ViewClock() as clock:
        run_live(brain, lm, runner, show_prompt=True, console=console)
    return runner.result.ticks / runner.result.seconds, clock.seconds / runner.result.seconds


def render_costs(lm, rows: int) -> tuple[float, float]:
    """Median ms to render one 120×40 frame and µs to take one snapshot, at `rows` live rows."""
    text = (DEFAULT_PROMPT + " ") * (rows // 10 + 1)
    ids = ([lm.bos_id] + lm.encode(text))[:rows]
    brain = Brain.start(lm, ids, BrainConfig(budget=max(rows, 64)))
    console = Console(file=io.StringIO(), force_terminal=True, width=120, height=40, color_system="truecolor")
    snaps, renders = [], []
    for _ in range(20):
        start = time.perf_counter()
        snapshot = take_snapshot(brain, lm, done=1, total=2)
        middle = time.perf_counter()
        console.render_lines(frame(snapshot, 120, 39), console.options)
        end = time.perf_counter()
        snaps.append(middle - start)
        renders.append(end - middle)
    return statistics.median(renders) * 1e3, statistics.median(snaps) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="random:tiny,smollm2")
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="plain/live pairs per model")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        lm = load_model(name, device="cpu", dtype="float32")
        plain_tok_s(lm, min(args.ticks, 20), args.budget)  # warm-up: first forwards are slow
        plain, live, busy = [], [], []
        for index in range(args.repeats):
            plain.append(plain_tok_s(lm, args.ticks, args.budget))
            rate, share = live_tok_s(lm, args.ticks, args.budget)
            live.append(rate)
            busy.append(share)
            print(f"# {name} pair {index + 1}/{args.repeats}: plain {plain[-1]:.2f} tok/s, live {rate:.2f} tok/s, "
                  f"view CPU {100 * share:.2f}% of the run", file=sys.stderr, flush=True)
        p, v = statistics.median(plain), statistics.median(live)
        rows.append((name, p, v, min(plain), max(plain), min(live), max(live), statistics.median(busy)))
        render_ms, snap_us = render_costs(lm, 500)
        print(f"# {name}: one 120×40 frame at 500 live rows renders in {render_ms:.1f} ms; "
              f"a snapshot takes {snap_us:.0f} µs", flush=True)
    print(f"\n{args.ticks} ticks, budget {args.budget}, {args.repeats} plain/live pairs, median tok/s (min–max)")
    print(f"{'model':>12} {'plain tok/s':>20} {'live tok/s':>20} {'live/plain':>11} {'view CPU':>9}")
    for name, p, v, p0, p1, v0, v1, share in rows:
        print(f"{name:>12} {p:>8.2f} ({p0:.1f}–{p1:.1f}) {v:>8.2f} ({v0:.1f}–{v1:.1f}) {v / p:>11.3f} "
              f"{100 * share:>8.2f}%")
    print("view CPU: CPU time of the view's redraws (render thread) and snapshots (loop thread) "
          "as a share of the run's wall time: the most it can take from the loop.")


if __name__ == "__main__":
    main()
