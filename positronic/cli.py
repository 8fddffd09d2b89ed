"""Command line: `positronic` / `python run.py`.

    python run.py --ticks 200                      # generate with the embedded model
    python run.py --model tinyllama --ticks 10000  # the live view when stdout is a terminal
    python run.py --session runs/a --ticks 500     # checkpoint every --save-every ticks
    python run.py --session runs/a --resume --ticks 500

Errors in flags, files or models print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import signal
import sys
from pathlib import Path
from typing import Optional

import click
import typer

try:  # typer >= 0.24 vendors click: its usage errors are not click's
    from typer.exceptions import TyperException as _TyperError
except ImportError:  # pragma: no cover - older typer
    _TyperError = click.ClickException

from .brain import session as sessions
from .brain.chat import LineReader
from .brain.loop import Brain, BrainConfig, TickRecord
from .brain.runner import Runner, RunResult, summary
from .state.manager import StateBrokenError
from .models import ModelError, load_model

DEFAULTS = BrainConfig()  # the CLI shows and uses the same defaults as the library
DEFAULT_PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old clockmaker who"

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Positronic Brain: a model that generates forever inside a fixed KV budget. "
                       "With no command: a run (the options below); `positronic run --help` shows the same.")


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


def show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("positronic-brain")
        except PackageNotFoundError:  # run from a checkout that was never installed
            number = "unknown (not installed)"
        print(f"positronic-brain {number}")
        raise typer.Exit()


def set_threads(threads: int | None) -> None:
    """--threads: torch's intra-op threads (default: torch's choice, one per core)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


@app.callback(invoke_without_command=True)
def run(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True, help="Print the version and exit."),
    model: str = typer.Option("smollm2", "-m", "--model", help="smollm2 (embedded) | tinyllama | a local dir or hub id | random:tinyllama | random:tiny"),
    ticks: int = typer.Option(300, "-n", "--ticks", min=-1, help="Ticks (generated tokens) to run; -1: no limit (Ctrl-C ends the run)."),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from this file."),
    pin: Optional[list[str]] = typer.Option(None, "--pin", help="Pin every occurrence of this text in the prompt: never evicted or repaired (repeatable)."),
    recall: bool = typer.Option(DEFAULTS.recall, "--recall/--no-recall", help="Bring evicted text back at its old positions when the newest token's query wants it (positronic/policies/recall.py)."),
    policy: str = typer.Option("brightness", help="Maintenance policy: brightness | streaming | scored | h2o | none | smartkv (each layer, or each kv head with per-head gates, keeps its own gate-ranked rows; docs/smartkv.md)."),
    gates: str = typer.Option(DEFAULTS.gates, help="Policy smartkv: a gate file (.safetensors, `positronic smartkv train`); default: the gates shipped for the model."),
    budget: int = typer.Option(128, "-c", "--budget", help="Live context budget: never exceeded after a tick (small by default, so a first run shows maintenance at work; DESIGN's reference is 500)."),
    sinks: int = typer.Option(4, min=0, help="Attention-sink rows never culled."),
    protect: int = typer.Option(0, min=0, help="Protected prefix rows (e.g. a system prompt)."),
    window: Optional[int] = typer.Option(None, min=0, help="Most recent rows never culled (default: 32; policy smartkv: half the budget)."),
    brightness: str = typer.Option(DEFAULTS.brightness, help="Brightness rule: ttl | vote."),
    ttl_decay: float = typer.Option(DEFAULTS.ttl_decay, min=0.0, help="ttl rule: brightness lost per tick."),
    ttl_gain: float = typer.Option(DEFAULTS.ttl_gain, min=0.0, help="ttl rule: brightness gained per unit of attention (what counts is gain/decay)."),
    unit: int = typer.Option(DEFAULTS.unit, min=0, help="Brightness policy: rows culled together (1 row, 2 pair, n chunk; 0: pairs with a repairer, else rows)."),
    repairer: str = typer.Option(DEFAULTS.repairer, help="none (cull only) | bridge (keep the pair's best token when it beats culling) | self (the model's guess) | mlm:PATH."),
    repair_tokens: int = typer.Option(1, min=1, help="Tokens a masked-LM repairer may propose per pair (self, bridge: exactly 1)."),
    bridge_margin: float = typer.Option(DEFAULTS.bridge_margin, help="Bridge repairer: nats by which keeping a token must beat culling the pair."),
    temperature: float = typer.Option(0.7, min=0.0, help="Sampling temperature (<= 0.001 is greedy)."),
    top_k: int = typer.Option(50, min=0, help="Top-k filter (0 = off)."),
    top_p: float = typer.Option(0.95, help="Top-p filter (1 = off)."),
    repetition_penalty: float = typer.Option(1.1, help="Repetition penalty (1 = off)."),
    seed: int = typer.Option(0, "-s", "--seed", help="Sampling seed."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, help="CPU threads for torch (default: one per core)."),
    repair_batch: int = typer.Option(DEFAULTS.repair_batch, min=1, help="Brightness policy: rows freed at once when the budget is reached (1 = one per tick; 8 keeps a CPU tick near plain decoding)."),
    refresh_every: int = typer.Option(0, min=0, help="Rebuild the cache from the mirror every N ticks (0 = never)."),
    refresh_kl: float = typer.Option(0.0, min=0.0, help="Every 50 ticks measure KL(fresh || spliced) in nats; rebuild above this (0 = off)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="float32 | float16 | bfloat16."),
    events: Optional[Path] = typer.Option(None, help="Write one JSON line per tick to this file."),
    session: Optional[Path] = typer.Option(None, help="Directory to checkpoint the run into."),
    save_every: int = typer.Option(100, min=1, help="Checkpoint every N ticks (with --session)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run saved in --session."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start a new run in a --session directory that holds a saved one (replaced once the new run has started), and/or over an existing --events file."),
    no_tui: bool = typer.Option(False, "--no-tui", help="Plain progress instead of the live view."),
    read_input: Optional[bool] = typer.Option(None, "--input/--no-input", help="Read lines typed while the agent runs as user turns: on the live view's input line when stdin is a terminal, else line by line from stdin (default: on, except --no-tui with stdin a terminal)."),
    kv_eviction: Optional[int] = typer.Option(None, help="llama.cpp alias: 0 = none, 1 = streaming, 2 = scored."),
    kv_sink_tokens: Optional[int] = typer.Option(None, help="llama.cpp alias of --sinks (0-256)."),
    kv_protected_tokens: Optional[int] = typer.Option(None, help="llama.cpp alias of --protect (>= 0)."),
    at_capacity: str = typer.Option(DEFAULTS.at_capacity, help="Policy none, cache full: stop | shift (llama.cpp context shift)."),
    capture: Optional[Path] = typer.Option(None, help="Save chosen ticks as .pt fixtures into this directory."),
    capture_ticks: str = typer.Option("repairs", help="Ticks to capture: repairs | all | a list like 5,17,40."),
    kv_format: str = typer.Option(DEFAULTS.kv_format, help="Cache rows: float (the model's dtype) | int4 | fp4 (4 bits + a float16 scale per row) | int4h (4 bits, keys centred before RoPE, K and V Hadamard-rotated, a scale and a zero point per 32 values; docs/kv_formats.md)."),
    kv_store: str = typer.Option(DEFAULTS.kv_store, help="Where cache rows live: splice (default) | ring (policy streaming, float rows: evictions only move a cursor; DESIGN.md §6)."),
) -> None:
    """Run the brain (the default command)."""
    if ctx.invoked_subcommand is not None:
        given = sorted(given_flags(ctx) - {"version"})
        if given:  # they would be silently ignored: the subcommand has its own options
            raise UserError(f"options before `{ctx.invoked_subcommand}` belong to a run ({', '.join('--' + name.replace('_', '-') for name in given)}); "
                            f"give {ctx.invoked_subcommand}'s options "
                            f"after it (e.g. `run.py {ctx.invoked_subcommand} --model …`)")
        return
    if ticks == 0:
        raise UserError("--ticks must be at least 1, or -1 for no limit")
    if prompt is not None and prompt_file is not None:
        raise UserError("give --prompt or --prompt-file, not both")
    if resume and session is None:
        raise UserError("--resume needs --session DIR")
    if resume and pin:
        raise UserError("--pin marks prompt text at the start of a run; a resumed run keeps the pins it has")
    if overwrite and ((session is None and events is None) or resume):
        raise UserError("--overwrite needs --session DIR or --events FILE and starts a new run: it cannot go with --resume")
    if prompt_file is not None:
        try:
            prompt = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read --prompt-file {prompt_file}: {getattr(exc, 'strerror', None) or exc}") from None
    config = brain_config(ctx, ctx.params)
    # outputs are checked before the model loads, not found unwritable after the work
    if events is not None:
        writable_directory(events.parent, "--events")
        if events.exists() and not (resume or overwrite):
            raise UserError(f"--events {events} already exists; replace it with --overwrite, or choose another file "
                            "(a --resume appends to it)")
    if session is not None:
        writable_directory(session, "--session")
        saved = session / sessions.MIRROR_FILE
        if saved.exists() and not (resume or overwrite):
            raise UserError(f"--session {session} already holds a saved run; continue it with --resume, "
                            "replace it with --overwrite, or choose another directory")
        if resume:
            refuse_changed_settings(ctx, config, sessions.load(session)[1]["config"])
    live = not (no_tui or not sys.stdout.isatty())
    typing, fd = input_source(read_input, live)
    inputs = queue.SimpleQueue() if typing else None
    if typing == "lines":  # read from now on (while the model loads too); stopped when the command ends
        ctx.call_on_close(LineReader(fd, inputs).start().close)
    set_threads(threads)
    if live:
        from .tui.app import loading
    with loading(model) if live else contextlib.nullcontext():  # the view opens only once the brain exists
        lm = load_model(model, device=device, dtype=dtype)
        if resume:
            brain = sessions.resume(lm, session)
        else:
            text = DEFAULT_PROMPT if prompt is None else prompt
            prompt_ids = [lm.bos_id] + lm.encode(text)
            brain = Brain.start(lm, prompt_ids, config, pins=pin or ())
            if overwrite and session is not None:  # at once, so that a resume after a crash cannot continue the old run
                sessions.save(session, brain, lm.name)
    if capture is not None:
        from .fixtures import Capture

        brain.observers.append(Capture(capture, lm, capture_ticks))
    runner = Runner(brain, lm.name, None if ticks == -1 else ticks, events=events, append_events=resume, session=session,
                    save_every=save_every, inputs=inputs)
    if not live:
        result = run_plain(brain, lm, runner, show_prompt=not resume)
    else:
        from .tui.app import run_live

        result = run_live(brain, lm, runner, show_prompt=not resume, keys=fd if typing == "keys" else None)
    if result.interrupted:  # the summary says so; the exit code tells scripts (130 Ctrl-C, 143 SIGTERM)
        raise typer.Exit(128 + int(result.signal or signal.SIGINT))


def input_source(read_input: bool | None, live: bool) -> tuple[str | None, int | None]:
    """How typed input reaches the run, and stdin's file descriptor: "keys" (the live view's
    input line: stdin is a terminal), "lines" (stdin read line by line: a pipe or a file; a
    terminal only with --input under --no-tui, where a background run reading it would be
    stopped), or None (--no-input, or no usable stdin)."""
    if read_input is False or os.name != "posix":
        return None, None
    try:
        fd = sys.stdin.fileno()
        terminal = os.isatty(fd)
    except (AttributeError, OSError, ValueError):  # no stdin, or one without a descriptor (pytest's)
        return None, None
    if terminal and live:
        return "keys", fd
    if terminal and not read_input:
        return None, None
    return "lines", fd


FLAG_ALIASES = {"kv_eviction": "policy", "kv_sink_tokens": "sinks", "kv_protected_tokens": "protect"}


def given_flags(ctx: typer.Context) -> set[str]:
    """The parameters the command line set (not defaults)."""
    # by name: typer may bring its own copy of click, with its own ParameterSource enum
    return {name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}


def refuse_conflicting_aliases(ctx: typer.Context) -> None:
    """UserError when a llama.cpp alias and the flag it stands for are both given: one of
    them would silently lose."""
    given = given_flags(ctx)
    both = [f"--{alias.replace('_', '-')} and --{flag}" for alias, flag in FLAG_ALIASES.items()
            if alias in given and flag in given]
    if both:
        raise UserError(f"{'; '.join(both)} set the same thing: give one of them")


def refuse_changed_settings(ctx: typer.Context, config: BrainConfig, saved: dict) -> None:
    """UserError if a flag given on the command line with --resume differs from the saved
    run's setting: a resumed run keeps its settings, and silently ignoring the flag would hide
    that."""
    given = given_flags(ctx)
    given |= {FLAG_ALIASES[name] for name in given if name in FLAG_ALIASES}
    changed = [f"--{name.replace('_', '-')} {getattr(config, name)} (saved: {saved[name]})"
               for name in sorted(given) if name in saved and getattr(config, name) != saved[name]]
    if changed:
        raise UserError("a resumed run keeps the settings it was saved with; these flags differ: "
                        + ", ".join(changed) + " (start a new --session to change them)")


def writable_directory(path: Path, flag: str) -> None:
    """UserError unless `path` is, or can be created as, a writable directory. Creates nothing:
    a run that stops on a bad flag leaves no trace."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"cannot use {flag} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot use {flag} {path}: {existing} is not writable")


def brain_config(ctx: typer.Context, options: dict) -> BrainConfig:
    """The validated BrainConfig of a command's options (`run`'s, and `serve`'s, which reuses
    them): the llama.cpp aliases mapped onto their flags, an alias given with its flag refused;
    settings the command has no option for keep the library's defaults."""
    refuse_conflicting_aliases(ctx)
    policy, sinks, protect = llama_cpp_aliases(options["policy"], options["sinks"], options["protect"],
                                               options.get("kv_eviction"), options.get("kv_sink_tokens"),
                                               options.get("kv_protected_tokens"))
    names = {f.name for f in dataclasses.fields(BrainConfig)}
    config = BrainConfig(**{name: value for name, value in options.items() if name in names}
                         | dict(policy=policy, sinks=sinks, protect=protect))
    config.validate()
    return config


def llama_cpp_aliases(policy: str, sinks: int, protect: int, kv_eviction: int | None, kv_sink_tokens: int | None,
                      kv_protected_tokens: int | None) -> tuple[str, int, int]:
    """Map llama.cpp's --kv-eviction/--kv-sink-tokens/--kv-protected-tokens onto our flags,
    with llama.cpp's validation."""
    if kv_eviction is not None:
        modes = {0: "none", 1: "streaming", 2: "scored"}
        if kv_eviction not in modes:
            raise UserError(f"--kv-eviction must be 0 (none), 1 (streaming) or 2 (scored), got {kv_eviction}")
        policy = modes[kv_eviction]
    if kv_sink_tokens is not None:
        if not 0 <= kv_sink_tokens <= 256:
            raise UserError(f"--kv-sink-tokens must be in 0..256, got {kv_sink_tokens}")
        sinks = kv_sink_tokens
    if kv_protected_tokens is not None:
        if kv_protected_tokens < 0:
            raise UserError(f"--kv-protected-tokens must be >= 0, got {kv_protected_tokens}")
        protect = kv_protected_tokens
    return policy, sinks, protect


def run_plain(brain: Brain, lm, runner: Runner, *, show_prompt: bool) -> RunResult:
    """Stream the generated text to stdout, a progress line to stderr every tenth of the run,
    then the summary."""
    out, err = sys.stdout, sys.stderr
    if show_prompt:
        out.write(lm.decode(brain.state.live_token_ids()[1:]))
    every = max(1, (runner.ticks or 1000) // 10)

    def on_tick(record: TickRecord, result: RunResult) -> None:
        out.write(record.text)
        out.flush()
        if result.ticks % every == 0 or result.ticks == runner.ticks:
            err.write(progress_line(brain, record, result, runner.ticks) + "\n")

    result = runner.run(on_tick)
    out.write("\n" + summary(brain, lm, result) + "\n")
    return result


def progress_line(brain: Brain, record: TickRecord, result: RunResult, total: int) -> str:
    c = brain.counts
    union = f" per layer, {record.live_tokens} tokens" if record.live_tokens != record.live_length else ""
    return (f"[{result.ticks}/{total or '∞'}] tick {record.tick}  live {record.live_length}/{brain.config.budget}{union}  "
            f"{result.ticks / result.seconds:.1f} tok/s  repairs {c['repairs']}  culls {c['culls']}  "
            f"rebuilds {c['rebuilds']}  "
            f"brightness {record.brightness_min:.0f}/{record.brightness_mean:.0f}/{record.brightness_max:.0f}")


# Subcommands register here, each importing its module only when run.


app.command("run", help="Run the brain (what `positronic` with no command does).")(run)


@app.command()
def replay(file: Path = typer.Argument(..., help="A captured .pt tick fixture.")) -> None:
    """Show what a captured tick does: its actions, and the text before and after."""
    from .fixtures import print_replay

    print_replay(file)


@app.command("eval")
def eval_command(
    model: str = typer.Option("smollm2", "-m", "--model", help="Model, as for the run command."),
    text: Optional[Path] = typer.Option(None, help="Text file to feed (default: texts/alice_ch1-2.txt)."),
    budget: Optional[list[int]] = typer.Option(None, help="Cache budget; repeat for several (default 128 256 512)."),
    policy: Optional[list[str]] = typer.Option(None, help="Policy; repeat for several (default: brightness, streaming, scored, h2o, none; smartkv on request)."),
    max_tokens: int = typer.Option(1024, help="Text tokens to score."),
    out: Path = typer.Option(Path("eval_results"), help="Directory for results.csv/.json and the PNG plot (with --generate: generation.csv/.json, texts/, side_by_side.md)."),
    segments: int = typer.Option(8, help="Perplexity segments reported per run."),
    sinks: int = typer.Option(4, min=0, max=256, help="Attention-sink rows never evicted."),
    protect: int = typer.Option(0, min=0, help="Protected prefix rows."),
    at_capacity: str = typer.Option(DEFAULTS.at_capacity, help="Policy none when full: stop | shift (as for the run command)."),
    probe: bool = typer.Option(True, "--probe/--no-probe", help="Run the retrieval probe too."),
    probe_filler: Optional[int] = typer.Option(None, help="Filler tokens in the probe, from the whole --text (default: max budget + 128, cut to the text; a text shorter than an explicit N is refused, and so is a probe longer than the model's positions)."),
    probe_at: float = typer.Option(0.0, help="Where the probe's fact goes: the fraction 0..1 of the filler before it (0: first, 1: right before the question); never inside the sink/protected rows (shifted past them)."),
    recall: bool = typer.Option(False, "--recall", help="Also run every policy but none and smartkv with recall on (rows POLICY+recall)."),
    smooth: Optional[int] = typer.Option(None, help="Moving-average window of the plot (tokens)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda."),
    dtype: Optional[str] = typer.Option(None, help="float32 | float16 | bfloat16."),
    repairer: str = typer.Option(DEFAULTS.repairer, help="The brightness policy's repairer: none (cull only) | bridge | self | mlm:PATH."),
    repair_batch: int = typer.Option(DEFAULTS.repair_batch, min=1, help="The brightness policy's rows freed at once at the budget (1 = one per tick)."),
    generate: Optional[int] = typer.Option(None, help="Generation mode: each policy and budget generates N tokens from the same prompt and seed; reports re-scored perplexity, distinct-4 and speed, and writes generation.csv/.json, texts/ and side_by_side.md. The teacher-forced perplexity and the probe are not run (--max-tokens, --segments, --probe, --probe-filler, --probe-at, --smooth are ignored; --recall is refused)."),
    prompt_tokens: int = typer.Option(128, help="With --generate: the prompt is BOS + the first N tokens of --text."),
    seed: int = typer.Option(0, help="With --generate: the sampling seed, the same for every run."),
    kv_format: str = typer.Option(DEFAULTS.kv_format, help="Cache rows: float (the model's dtype) | int4 | fp4 (4 bits + a float16 scale per row) | int4h (4 bits, keys centred before RoPE, K and V Hadamard-rotated, a scale and a zero point per 32 values; docs/kv_formats.md)."),
    kv_store: str = typer.Option(DEFAULTS.kv_store, help="Where cache rows live: splice (default) | ring (policy streaming, float rows: evictions only move a cursor; DESIGN.md §6)."),
    gates: str = typer.Option(DEFAULTS.gates, help="Policy smartkv: a gate file (.safetensors); default: the gates shipped for the model."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, help="CPU threads for torch (default: one per core)."),
) -> None:
    """Perplexity of a text through a bounded cache, per policy and budget, plus a retrieval probe;
    with --generate N, the quality of N freely generated tokens instead."""
    writable_directory(out, "--out")
    set_threads(threads)
    if generate is not None:
        if recall:
            raise UserError("--recall applies to the teacher-forced eval and its probe, not to --generate")
        if kv_store != "splice":
            raise UserError("--kv-store ring applies to the teacher-forced eval, not (yet) to --generate")
        from .evaluate.generation import main as generation_main

        report = generation_main(generate=generate, model=model, text=text, budgets=budget, policies=policy,
                                 prompt_tokens=prompt_tokens, seed=seed, out=out, sinks=sinks, protect=protect,
                                 at_capacity=at_capacity, device=device, dtype=dtype, repairer=repairer,
                                 repair_batch=repair_batch, kv_format=kv_format)
        if any(run.error for run in report.runs + ([report.reference] if report.reference else [])):
            raise typer.Exit(1)  # a run ended on a tick that failed twice: its files are written, but say so
        return
    from .evaluate import main as evaluate_main

    evaluate_main(model=model, text=text, budgets=budget, policies=policy, max_tokens=max_tokens, out=out,
                  segments=segments, sinks=sinks, protect=protect, at_capacity=at_capacity, probe=probe,
                  probe_filler=probe_filler, smooth=smooth, device=device, dtype=dtype, repairer=repairer,
                  repair_batch=repair_batch, probe_at=probe_at, recall=recall, kv_format=kv_format, gates=gates,
                  kv_store=kv_store)


@app.command("smartkv", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             help="SmartKV gates: `positronic smartkv train --model smollm2 --text T --heldout H --out G.safetensors` "
                  "(`positronic smartkv train -h` for every option).")
def smartkv_command(ctx: typer.Context) -> None:
    from .smartkv.__main__ import main as smartkv_main

    code = smartkv_main(list(ctx.args))
    if code:
        raise typer.Exit(code)


from .server.cli import serve_command  # noqa: E402  (it reuses the run's options, defined above)

app.command("serve", help="Serve the brain over HTTP: an OpenAI-compatible API, one brain per session "
                          "(positronic/server/app.py).")(serve_command(run, brain_config))


def entry() -> None:
    """The process entry point (`run.py`, the `positronic` command): `main`, and then Ctrl-C is
    ignored. The work is done and saved by then, and a Ctrl-C while the interpreter tears down
    (unloading torch takes a moment) would otherwise turn a finished run's exit status into
    "killed by SIGINT". Not for in-process callers: it changes the process's SIGINT handling."""
    try:
        main()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one clear line and exit code 2 for anything the user can fix."""
    try:
        code = app(args=argv, standalone_mode=False)
        if code == 130:  # click turned a Ctrl-C (e.g. while the model loads) into a return code
            print("interrupted", file=sys.stderr)
        if isinstance(code, int) and code:
            sys.exit(code)
    except (typer.Exit, click.exceptions.Exit) as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, click.exceptions.Abort, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)  # e.g. Ctrl-C while the model loads: no traceback
        sys.exit(130)
    except (_TyperError, click.ClickException) as exc:
        print(f"error: {' '.join(exc.format_message().split())}", file=sys.stderr)
        sys.exit(2)
    except (UserError, ModelError, sessions.SessionError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except StateBrokenError as exc:  # not the user's doing, and nothing was saved
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
