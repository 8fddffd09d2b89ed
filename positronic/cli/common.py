"""What the commands share: the user's errors (one line, exit code 2), the checks on flags
and output directories, and the BrainConfig a command's options make (`run`'s and `serve`'s,
which reuses them)."""

from __future__ import annotations

import dataclasses
import re
import os
from pathlib import Path

import typer

from ..brain.config import AUTO_GATES, ConfigError
from ..brain.loop import BrainConfig
from ..policies import reads_window, window_refusal

DEFAULTS = BrainConfig()  # the CLI shows and uses the same defaults as the library
# --threads' ceiling: torch takes a C int (-t 2147483648 was "Overflow when unpacking long",
# naming no flag), and threads past a host's cores only slow each forward down
MAX_THREADS = 1024


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


def flag_error(exc: ConfigError, names, given=()) -> UserError:
    """A setting's ConfigError as the UserError that names the command's flag for it (`--top-p
    must be in (0, 1]` for top_p), when `names` (the command's parameters) has one: the
    llama.cpp alias instead where that is what was `given`."""
    message = str(exc)
    if exc.field not in names:
        return UserError(message)
    name = next((alias for alias, field in FLAG_ALIASES.items() if field == exc.field and alias in given), exc.field)
    flag = "--" + name.replace("_", "-")
    if message.startswith(exc.field):
        return UserError(flag + message[len(exc.field):])
    return UserError(message if flag in message else f"{flag}: {message}")


def set_threads(threads: int | None) -> None:
    """--threads: torch's intra-op threads in this thread (default: torch's choice, one per core)."""
    if threads is not None:
        from ..batch.threads import set_threads as set_torch_threads

        set_torch_threads(threads)


OWNS_PROCESS = False  # set by cli.entry(): the command is the whole process, not a call inside another


def freeze_heap() -> None:
    """Once the model has loaded, in a process the command owns: the model's and the
    tokenizer's Python objects (~378,000 for SmolLM2) live as long as the process, so the
    garbage collector stops walking them (`gc.freeze`). A full collection took 157-184 ms
    with them and under 1 ms without, for one brain; in `serve` at 8 clients 240 ms each
    against 48 ms, every session stalled meanwhile (bench/results/history/batch.md). A caller in
    its own process (tests, a notebook) keeps its collector as it is."""
    if not OWNS_PROCESS:
        return
    import gc

    gc.collect()  # what loading left behind goes now, not frozen with the rest
    gc.freeze()



FLAG_ALIASES = {"kv_eviction": "policy", "kv_sink_tokens": "sinks", "kv_protected_tokens": "protect",
                "n_gpu_layers": "device"}


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
    settings = ({name: value for name, value in options.items() if name in names}
                | dict(policy=policy, sinks=sinks, protect=protect, logit_bias=logit_bias_option(options),
                       policy_options=",".join(options.get("policy_option") or ())))
    given, choice = given_flags(ctx), None
    if "model" in options and not ({"policy", "kv_eviction"} & given) and not options.get("resume"):
        from ..brain.defaults import default_policy

        asked = dict(window=options.get("window"), recall=options["recall"] if "recall" in given else None,
                     memory_rank=options.get("memory_rank"))
        base = BrainConfig(**settings | dict(policy=policy))
        choice = default_policy(options["model"], base, train=True, **asked)
        if choice.gates == AUTO_GATES:  # trained once the model loads; where they cannot be, the gate-free default
            free = default_policy(options["model"], base, **asked)
            ctx.meta["gate_free"] = (BrainConfig(**settings | dict(policy=free.policy, recall=free.recall)),
                                     f"positronic: {free.note}")
        policy = choice.policy
        settings |= dict(policy=policy, recall=choice.recall) | ({"gates": choice.gates} if choice.gates else {})
    if options.get("reread") is None and options.get("engine_smartkv" if "engine_smartkv" in options else "compile"):
        # Core v4's rounds (run --compile, serve --engine-smartkv) do not reread yet: their default is off
        settings["reread"] = False
    config = BrainConfig(**settings)
    try:
        config.validate()
    except ConfigError as exc:
        if exc.field == "policy_options":
            raise UserError(f"--policy-option: {exc}") from None
        raise flag_error(exc, options, given_flags(ctx)) from None
    if choice is not None:  # said by the command once the model loaded, not above an error about anything else
        ctx.meta["policy_note"] = f"positronic: {choice.note}"
    if "window" in given_flags(ctx) and not reads_window(policy):
        raise flag_error(ConfigError("window", window_refusal(policy)), options)
    return config


def with_gates(ctx: typer.Context, lm, config: BrainConfig) -> BrainConfig:
    """`config` with gates "auto" made a file once the model is loaded: the shipped gates, kept
    ones, or gates trained now (smartkv/first_use.py; its lines on stderr). Where none can be
    trained, the default policy's run goes on gate-free and its note says why; a run that asked
    for `--gates auto` stops with the reason."""
    config, note = resolve_gates(lm, config, ctx.meta.get("gate_free"))
    if note:
        ctx.meta["policy_note"] = note
    return config


def resolve_gates(lm, config: BrainConfig, gate_free: tuple[BrainConfig, str] | None) -> tuple[BrainConfig, str | None]:
    """with_gates without the command's context (a server replica's): `gate_free` is the
    default's fallback (`brain_config` keeps it in ctx.meta), None where `--gates auto` was
    asked for. Returns the config and, on the fallback, the note that says why."""
    if config.gates != AUTO_GATES:
        return config, None
    from ..smartkv.first_use import GateTrainingError, resolve

    try:
        return dataclasses.replace(config, gates=resolve(lm)), None
    except GateTrainingError as exc:
        if gate_free is None:
            raise UserError(f"--gates auto: {exc}") from None
        config, note = gate_free
        try:
            config.validate()  # SmartKV took these settings; the gate-free policy may not (a budget too small)
        except ConfigError as refused:
            raise UserError(f"{exc}; the gate-free default cannot run either: {refused}") from None
        return config, f"{note} ({exc})"


def logit_bias_option(options: dict) -> str:
    """--logit-bias's entries (ID:BIAS, or llama.cpp's ID+BIAS / ID-BIAS) as a BrainConfig's
    logit_bias; UserError naming a malformed one."""
    from ..brain.config import logit_bias_text, parse_logit_bias

    entries = [re.sub(r"^(\d+)([+-])", r"\1:\2", entry.strip()) for entry in options.get("logit_bias") or ()]
    try:
        return logit_bias_text(parse_logit_bias(",".join(entries)))
    except ValueError as exc:
        raise UserError(f"--logit-bias: {exc}") from None


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

