"""Command line: `positronic` / `python run.py`.

    python run.py --ticks 200                      # generate with the embedded model
    python run.py --model tinyllama --ticks 10000  # the live view when stdout is a terminal
    python run.py --session runs/a --ticks 500     # checkpoint every --save-every ticks
    python run.py --session runs/a --resume --ticks 500

Errors in flags, files or models print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import click
import typer

try:  # typer >= 0.24 vendors click: its usage errors are not click's
    from typer.exceptions import TyperException as _TyperError
except ImportError:  # pragma: no cover - older typer
    _TyperError = click.ClickException

from . import session as sessions
from .loop import Brain, BrainConfig, TickRecord
from .models import ModelError, load_model

DEFAULT_PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old clockmaker who"

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Positronic Brain: a model that generates forever inside a fixed KV budget.")


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


def rss_mb() -> float:
    """Resident memory of this process in MiB (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@app.callback(invoke_without_command=True)
def run(
    ctx: typer.Context,
    model: str = typer.Option("smollm2", help="smollm2 (embedded) | tinyllama | a local dir or hub id | random:tinyllama | random:tiny"),
    ticks: int = typer.Option(200, min=1, help="Ticks (generated tokens) to run."),
    prompt: Optional[str] = typer.Option(None, help="Prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from this file."),
    budget: int = typer.Option(500, help="Target live context length."),
    sinks: int = typer.Option(4, min=0, help="Attention-sink rows never culled."),
    protect: int = typer.Option(0, min=0, help="Protected prefix rows (e.g. a system prompt)."),
    window: int = typer.Option(32, min=0, help="Most recent rows never culled."),
    brightness: str = typer.Option("ttl", help="Brightness rule: ttl | vote."),
    repairer: str = typer.Option("self", help="self | mlm:PATH (a local masked LM)."),
    repair_tokens: int = typer.Option(1, min=1, help="Tokens the self repairer proposes per pair."),
    temperature: float = typer.Option(0.7, min=0.0, help="Sampling temperature (<= 0.001 is greedy)."),
    top_k: int = typer.Option(50, min=0, help="Top-k filter (0 = off)."),
    top_p: float = typer.Option(0.95, help="Top-p filter (1 = off)."),
    repetition_penalty: float = typer.Option(1.1, help="Repetition penalty (1 = off)."),
    seed: int = typer.Option(0, help="Sampling seed."),
    refresh_every: int = typer.Option(0, min=0, help="Rebuild the cache from the mirror every N ticks (0 = never)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="float32 | float16 | bfloat16."),
    store: str = typer.Option("dynamic", help="KV store backend."),
    events: Optional[Path] = typer.Option(None, help="Write one JSON line per tick to this file."),
    session: Optional[Path] = typer.Option(None, help="Directory to checkpoint the run into."),
    save_every: int = typer.Option(100, min=1, help="Checkpoint every N ticks (with --session)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run saved in --session."),
    no_tui: bool = typer.Option(False, "--no-tui", help="Plain progress instead of the live view."),
) -> None:
    """Run the brain (the default command)."""
    if ctx.invoked_subcommand is not None:
        return
    if prompt is not None and prompt_file is not None:
        raise UserError("give --prompt or --prompt-file, not both")
    if resume and session is None:
        raise UserError("--resume needs --session DIR")
    if prompt_file is not None:
        try:
            prompt = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read --prompt-file {prompt_file}: {getattr(exc, 'strerror', None) or exc}") from None
    config = BrainConfig(budget=budget, sinks=sinks, protect=protect, window=window, brightness=brightness,
                         repairer=repairer, repair_tokens=repair_tokens, temperature=temperature, top_k=top_k,
                         top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, refresh_every=refresh_every)
    config.validate()
    lm = load_model(model, device=device, dtype=dtype)
    if resume:
        brain = sessions.resume(lm, session, store=store)
    else:
        text = DEFAULT_PROMPT if prompt is None else prompt
        prompt_ids = [lm.bos_id] + lm.encode(text)
        if len(prompt_ids) + ticks > lm.max_positions and len(prompt_ids) >= budget:
            raise UserError(f"the prompt has {len(prompt_ids)} tokens; the budget is {budget}")
        brain = Brain.start(lm, prompt_ids, config, store=store)
    plain = no_tui or not sys.stdout.isatty()
    run_plain(brain, lm, ticks, events=events, session=session, save_every=save_every, show_prompt=not resume)
    del plain  # the live view arrives with the terminal UI


def run_plain(brain: Brain, lm, ticks: int, *, events: Path | None, session: Path | None, save_every: int,
              show_prompt: bool) -> None:
    """Stream the generated text to stdout, progress to stderr, then a summary."""
    out, err = sys.stdout, sys.stderr
    if show_prompt:
        out.write(lm.decode(brain.state.live_token_ids()[1:]))
    log = open(events, "a" if not show_prompt else "w", encoding="utf-8") if events else None
    start, first_tick, every = time.perf_counter(), brain.tick, max(1, ticks // 10)
    rss = {}
    try:
        for done in range(1, ticks + 1):
            record = brain.step()
            out.write(record.text)
            out.flush()
            if log:
                log.write(json.dumps(record.to_json()) + "\n")
            if session and brain.tick % save_every == 0:
                sessions.save(session, brain, lm.name)
            if done in (1000, 10000):
                rss[done] = rss_mb()
            if done % every == 0 or done == ticks:
                rate = done / (time.perf_counter() - start)
                err.write(progress_line(brain, record, done, ticks, rate) + "\n")
    except KeyboardInterrupt:
        err.write("\ninterrupted\n")
    finally:
        if log:
            log.close()
        if session:
            path = sessions.save(session, brain, lm.name)
            err.write(f"session saved: {path} (tick {brain.tick})\n")
    elapsed = time.perf_counter() - start
    out.write("\n")
    out.write(summary(brain, lm, brain.tick - first_tick, elapsed, rss) + "\n")


def progress_line(brain: Brain, record: TickRecord, done: int, total: int, rate: float) -> str:
    c = brain.counts
    return (f"[{done}/{total}] tick {record.tick}  live {record.live_length}/{brain.config.budget}  "
            f"{rate:.1f} tok/s  repairs {c['repairs']}  culls {c['culls']}  rebuilds {c['rebuilds']}  "
            f"brightness {record.brightness_min:.0f}/{record.brightness_mean:.0f}/{record.brightness_max:.0f}")


def summary(brain: Brain, lm, ticks: int, elapsed: float, rss: dict[int, float]) -> str:
    c, ledger = brain.counts, brain.state.mirror.ledger
    lines = [
        "--- summary ---",
        f"model {lm.name} on {lm.device} ({str(lm.dtype).removeprefix('torch.')}), store {type(brain.state.store).__name__}",
        f"ticks {ticks} in {elapsed:.1f} s ({ticks / max(elapsed, 1e-9):.2f} tok/s); now at tick {brain.tick}",
        f"live {len(brain.state)} / budget {brain.config.budget}; ledger {len(ledger)} tokens "
        f"({ledger.count('culled')} culled, {ledger.count('replaced')} replaced)",
        f"repairs {c['repairs']}  culls {c['culls']}  rebuilds {c['rebuilds']}  refreshes {c['refreshes']}",
        f"cache {brain.state.store.memory_usage_mb():.1f} MiB  RSS {rss_mb():.0f} MiB"
        + "".join(f"  (RSS at {k} ticks: {v:.0f} MiB)" for k, v in rss.items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one clear line and exit code 2 for anything the user can fix."""
    try:
        app(args=argv, standalone_mode=False)
    except (typer.Exit, click.exceptions.Exit) as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, click.exceptions.Abort):
        sys.exit(130)
    except (_TyperError, click.ClickException) as exc:
        print(f"error: {' '.join(exc.format_message().split())}", file=sys.stderr)
        sys.exit(2)
    except (UserError, ModelError, sessions.SessionError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
