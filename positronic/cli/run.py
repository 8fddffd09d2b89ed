"""The run command (`positronic`, `positronic run`, `python run.py`): its options, their
checks, and a run with the live view or plain progress."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from positronic.mirror.storage import regular_file

from ..brain import session as sessions
from ..brain.chat import LineReader
from ..brain.dialogue import CHAT_TEMPLATES, Dialogue
from ..brain.config import BUDGET, RUN_BUDGET
from ..brain.loop import Brain, TickRecord
from ..brain.runner import Runner, RunResult, events_run_id, summary
from ..models import load_model, random_names
from ..policies import POLICIES
from ..tui.snapshot import shades
from ..util import read_text_file
from .common import (DEFAULTS, MAX_THREADS, UserError, brain_config, freeze_heap, given_flags, refuse_changed_settings,
                     set_threads, show_version, with_gates, writable_directory)

DEFAULT_PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old clockmaker who"


def run(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True, help="Print the version and exit."),
    model: str = typer.Option("smollm2", "-m", "--model", help="smollm2 (embedded) | tinyllama | a local dir, a .gguf file (converted once "
                              f"into the cache) or a hub id | random weights: {' | '.join(random_names())}"),
    ticks: int = typer.Option(300, "-n", "--ticks", "--n-predict", min=-1, max=sessions.MAX_TICK, help="Ticks (generated tokens) to run, at most 2**53 (what a session counts exactly); -1: no limit (Ctrl-C ends the run)."),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, "-f", "--prompt-file", "--file", help="Read the prompt from this file (llama.cpp: -f/--file)."),
    pin: Optional[list[str]] = typer.Option(None, "--pin", help="Pin every occurrence of this text in the prompt: never evicted or repaired (repeatable)."),
    recall: bool = typer.Option(DEFAULTS.recall, "--recall/--no-recall", help="Bring evicted text back at its old positions when the newest token's query wants it (positronic/policies/recall.py). On by default where the default policy is smartkv; --no-recall turns it off."),
    policy: str = typer.Option("brightness", show_default=False, help=f"Maintenance policy: {' | '.join(POLICIES)} (default: smartkv with recall, on the gates shipped for the model (smollm2) or else trained on its first use (--gates auto); brightness for random weights; docs/policies.md; smartkv: each layer, or each kv head with per-head gates, keeps its own gate-ranked rows, docs/smartkv.md)."),
    policy_option: Optional[list[str]] = typer.Option(None, "--policy-option", help="NAME=VALUE: a setting of a policy made from a press (positronic/presses/, e.g. knorm's mix; docs/policies.md, \"A policy in one file\"); repeatable."),
    gates: str = typer.Option(DEFAULTS.gates, help="Policy smartkv: a gate file (.safetensors, `positronic smartkv train`), or auto: the gates shipped for the model, else gates trained on its first use and kept (about a minute for SmolLM2-135M on 2 cores; docs/smartkv.md). Default: the shipped gates; the default policy of a model without them uses auto."),
    memory_rank: Optional[str] = typer.Option(None, show_default=False, help="Policy smartkv: how each lane's memory ranks its rows: gates (the lifespan the gates predict) | recent (that, times (1 + the attention the lane paid the row lately) squared; docs/smartkv.md). Default: recent with recall (as the default policy runs), gates without: each the best measured."),
    reread: Optional[bool] = typer.Option(None, "--reread/--no-reread", show_default=False, help="Policy smartkv with recall: recall looks right after each token's forward, and that token is read again with what came back (one more forward, only when something came back), so the token the look was for is predicted with it, not the one after (docs/smartkv.md, \"Reread\"). Default: on with recall, except under --compile (its rounds do not reread yet)."),
    budget: int = typer.Option(RUN_BUDGET, "-c", "--budget", "--ctx-size", help=f"Live context budget: never exceeded after a tick (small by default, so a first run shows maintenance at work; DESIGN's reference is {BUDGET})."),
    sinks: int = typer.Option(4, min=0, help="Attention-sink rows never culled."),
    protect: int = typer.Option(0, "--protect", "--keep", min=0, help="Protected prefix rows (e.g. a system prompt; llama.cpp: --keep)."),
    window: Optional[int] = typer.Option(None, min=0, help="Most recent rows never culled (default: 32; policy smartkv: half the budget)."),
    brightness: str = typer.Option(DEFAULTS.brightness, help="Brightness rule: ttl | vote."),
    ttl_decay: float = typer.Option(DEFAULTS.ttl_decay, min=0.0, help="ttl rule: brightness lost per tick."),
    ttl_gain: float = typer.Option(DEFAULTS.ttl_gain, min=0.0, help="ttl rule: brightness gained per unit of attention (what counts is gain/decay)."),
    unit: int = typer.Option(DEFAULTS.unit, min=0, help="Brightness policy: rows culled together (1 row, 2 pair, n chunk; 0: pairs with a repairer, else rows)."),
    repairer: str = typer.Option(DEFAULTS.repairer, help="none (cull only) | bridge (keep the pair's best token when it beats culling) | self (the model's guess) | mlm:PATH."),
    repair_tokens: int = typer.Option(1, min=1, help="Tokens a masked-LM repairer may propose per pair (self, bridge: exactly 1)."),
    bridge_margin: float = typer.Option(DEFAULTS.bridge_margin, help="Bridge repairer: nats by which keeping a token must beat culling the pair."),
    temperature: float = typer.Option(0.7, "--temperature", "--temp", min=0.0, help="Sampling temperature (<= 0.001 is greedy)."),
    top_k: int = typer.Option(50, min=0, help="Top-k filter (0 = off)."),
    top_p: float = typer.Option(0.95, help="Top-p filter (1 = off)."),
    repetition_penalty: float = typer.Option(1.1, "--repetition-penalty", "--repeat-penalty", help="Repetition penalty (1 = off)."),
    min_p: float = typer.Option(0.0, help="Min-p filter: keep tokens at least this fraction as likely as the most likely one (0 = off)."),
    presence_penalty: float = typer.Option(0.0, help="OpenAI's presence penalty, -2..2: subtracted once from each token in the last 64."),
    frequency_penalty: float = typer.Option(0.0, help="OpenAI's frequency penalty, -2..2: subtracted per occurrence in the last 64 tokens."),
    logit_bias: Optional[list[str]] = typer.Option(None, help="Add BIAS (-100..100) to token ID's logit: ID:BIAS, or llama.cpp's ID+BIAS / ID-BIAS; repeatable."),
    seed: int = typer.Option(0, "-s", "--seed", help="Sampling seed."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, max=MAX_THREADS, help="CPU threads for torch (default: one per core)."),
    repair_batch: int = typer.Option(DEFAULTS.repair_batch, min=1, help="Brightness policy: rows freed at once when the budget is reached (1 = one per tick; 8 keeps a CPU tick near plain decoding)."),
    evict_every: int = typer.Option(0, min=0, help="Shared-row policies (brightness, streaming, scored, h2o, random): edit once every N ticks, freeing N rows (1: one row every tick; the live length stays within budget - N + 1..budget). 0: each policy's own (llama.cpp's budget/16 + 1; brightness: --repair-batch). Quality and speed of N: bench/results/policies.md."),
    refresh_every: int = typer.Option(0, min=0, help="Rebuild the cache from the mirror every N ticks (0 = never)."),
    refresh_kl: float = typer.Option(0.0, min=0.0, help="Every 50 ticks measure KL(fresh || spliced) in nats; rebuild above this (0 = off)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    n_gpu_layers: Optional[int] = typer.Option(None, "-ngl", "--n-gpu-layers", "--gpu-layers", min=0, help="llama.cpp alias of --device: 0 = cpu; any N > 0 = cuda, every layer (no partial offload)."),
    dtype: Optional[str] = typer.Option(None, help="float32 | float16 | bfloat16 | auto: the checkpoint's own dtype (a bf16 checkpoint stays bf16). Default: float16 on cuda, float32 on cpu."),
    weights: Optional[str] = typer.Option(None, help="float32 | bfloat16 | int8 | int8-weight-only | int4 | auto: the CPU linear layers' format (docs/weights.md). auto (default): for a GGUF file of quantized weights (Q4_0, Q4_1, Q8_0, ...) int8, or int8-weight-only with --compile; else float32. int8-weight-only with --compile: fastest on a CPU; int4: least memory."),
    compile: bool = typer.Option(False, "--compile/--no-compile", help="Each tick a Core v4 engine round of one whose forward is one compiled graph (torch.compile; Llama-class models with float or int8-weight-only weights, the policies Core v4 runs): compiled before the first tick, about 40 s for SmolLM2 on 2 CPU cores (5 s for a tiny model); with --weights int8-weight-only SmolLM2 then ticks ~4x faster than float32 uncompiled. Tokens may part from an uncompiled run's at a near-tie (docs/core.md, \"A lone stream\")."),
    events: Optional[Path] = typer.Option(None, help="Write one JSON line per tick to this file."),
    session: Optional[Path] = typer.Option(None, help="Directory to checkpoint the run into."),
    save_every: int = typer.Option(100, min=1, max=sessions.MAX_TICK, help="Checkpoint every N ticks (with --session)."),
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
    conversation: Optional[bool] = typer.Option(None, "--conversation/--no-conversation", "-cnv/-no-cnv", show_default=False, help="Conversation mode (llama-cli's -cnv): each line on stdin a user turn in the model's chat template, the reply generated until the model ends its turn or -n tokens, then the next line; -p is the system message. Default: on when stdin is a pipe, no prompt is given and the model has a chat template (docs/cli.md)."),
    interactive: bool = typer.Option(False, "-i", "--interactive", help="llama.cpp's interactive mode: here conversation mode (-cnv), with the plain 'User:/Assistant:' frame where the model has no chat template."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Conversation mode: a reply does not end at end-of-sequence, only at -n tokens (a story run never stops there anyway)."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help=f"The chat template typed lines are framed in: {' | '.join(CHAT_TEMPLATES)} (plain: 'User:/Assistant:'), a Jinja template, or a file of one. Default: the model's own."),
    grammar: Optional[str] = typer.Option(None, "--grammar", help="llama.cpp's GBNF grammar the generated text keeps to (in conversation mode, each reply); the run ends when it is whole. Needs llguidance (the serve extra)."),
    grammar_file: Optional[Path] = typer.Option(None, "--grammar-file", help="--grammar read from a file."),
    json_schema: Optional[str] = typer.Option(None, "-j", "--json-schema", help="A JSON schema the generated text is JSON for (llama.cpp's -j; '{}' any JSON value)."),
    json_schema_file: Optional[Path] = typer.Option(None, "--json-schema-file", help="--json-schema read from a file."),
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
    if interactive and conversation is False:
        raise UserError("-i/--interactive is conversation mode here: it cannot go with --no-conversation")
    conversation = True if interactive else conversation
    if conversation and read_input is False:
        raise UserError("conversation mode reads its turns from stdin: it cannot go with --no-input")
    template = chat_template_text(chat_template) if chat_template is not None else None
    wanted = grammar_of(grammar, grammar_file, json_schema, json_schema_file)
    if wanted is not None and resume:
        raise UserError("--grammar/--json-schema hold a run's text from its start: they cannot go with --resume")
    if resume and (prompt is not None or prompt_file is not None):
        raise UserError("--prompt/--prompt-file start a run; a resumed run goes on from its saved context "
                        "(type a line to add a user turn, or start a new --session)")
    given = given_flags(ctx)
    if n_gpu_layers is not None:  # llama.cpp's -ngl says where the model runs (with --device: refused as both)
        import torch

        if n_gpu_layers and not torch.cuda.is_available():
            raise UserError(f"--n-gpu-layers {n_gpu_layers} puts the model on a GPU, and none is available here "
                            "(-ngl 0: the CPU)")
        device = "cpu" if n_gpu_layers == 0 else "cuda"
    for flag, needs, name in (("capture_ticks", capture, "--capture DIR"), ("save_every", session, "--session DIR")):
        if flag in given and needs is None:  # read only with the other: alone it would be silently ignored
            raise UserError(f"--{flag.replace('_', '-')} applies to {name.split()[0]}: give {name}")
    if compile and capture is not None:
        raise UserError("--capture records each tick's action list as the brain applies it, and --compile's "
                        "ticks are engine rounds that make none: give one of them")
    if capture is not None:
        from ..fixtures import parse_spec

        try:
            parse_spec(capture_ticks)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    if prompt_file is not None:
        try:
            prompt = read_text_file(prompt_file, "--prompt-file")
        except OSError as exc:
            raise UserError(str(exc)) from None
    for needle in pin or ():  # the tokens are matched once the model loads; text that is not there never will be
        if not needle or needle not in (DEFAULT_PROMPT if prompt is None else prompt):
            raise UserError(f"--pin {needle!r} does not occur in the prompt")
    config = brain_config(ctx, ctx.params)
    # outputs are checked before the model loads, not found unwritable after the work
    if events is not None:
        writable_directory(events.parent, "--events")
        if events.is_dir():
            raise UserError(f"--events {events} is a directory: give a file")
        if resume and events.exists():  # its header is read and it is rewritten: only a file of its own will do
            try:
                regular_file(events)
            except OSError as exc:
                raise UserError(f"--events {events} with --resume: {exc.strerror or exc}") from None
        if events.exists() and not (resume or overwrite):
            raise UserError(f"--events {events} already exists; replace it with --overwrite, or choose another file "
                            "(a --resume appends to it)")
    if capture is not None:
        writable_directory(capture, "--capture")
        if config.kv_store == "ring":
            raise UserError("--capture records ticks of the splice store (a fixture replays splices); "
                            "the ring store has none: leave out --capture or --kv-store ring")
    if session is not None:
        writable_directory(session, "--session")
        saved = session / sessions.MIRROR_FILE
        if saved.exists() and not (resume or overwrite):
            raise UserError(f"--session {session} already holds a saved run; continue it with --resume, "
                            "replace it with --overwrite, or choose another directory")
        # held until the command ends, from before the saved run is read; a refusal from here on
        # (even once the model has loaded) removes the lock file and the directories it made
        ctx.with_resource(sessions.locked(session, "run.py"))
        if resume:
            meta = sessions.load(session)[1]
            refuse_changed_settings(ctx, config, meta["config"])
            if events is not None and events.exists() and events_run_id(events) != meta.get("run_id"):
                raise UserError(f"--events {events} is not this session's event log (its header names another run, "
                                "or none): a resumed run appends only to its own; choose another file")
    # a pipe of lines and no prompt may be questions for a chat model (decided once it loads): plain output
    maybe_chat = conversation is None and prompt is None and not resume and not stdin_is_terminal()
    live = not (no_tui or not sys.stdout.isatty() or conversation or maybe_chat)
    typing, fd = input_source(True if conversation else read_input, live)
    inputs = queue.SimpleQueue() if typing else None
    if typing == "lines":  # read from now on (while the model loads too); stopped when the command ends
        ctx.call_on_close(LineReader(fd, inputs, mark_end=bool(conversation or maybe_chat)).start().close)
    if conversation and typing != "lines":
        raise UserError("conversation mode reads its turns from stdin, and there is none here")
    set_threads(threads)
    if live:
        from ..tui.app import loading
    with loading(model) if live else contextlib.nullcontext():  # the view opens only once the brain exists
        lm = load_model(model, device=device, dtype=dtype, weights=weights, compiled=compile)
        freeze_heap()
        config = with_gates(ctx, lm, config)  # --gates auto: kept, or trained now on first use
        if template is not None:
            lm.tokenizer.chat_template = template or None  # "" (plain): none
        if maybe_chat and typing == "lines" and getattr(lm.tokenizer, "chat_template", None):
            conversation = True
            print(f"conversation mode: the lines on stdin are questions for {lm.name}'s chat template "
                  "(-no-cnv: a story run that reads them as turns)", file=sys.stderr)
        dialogue = None
        if conversation:
            dialogue = Dialogue(lm, inputs, reply_tokens=None if ticks == -1 else ticks, ignore_eos=ignore_eos,
                                on_refused=lambda message: print(message, file=sys.stderr, flush=True),
                                prompt=terminal_prompt if stdin_is_terminal() else lambda: None, grammar=wanted)
        constraint = checked_constraint(wanted, lm) if wanted is not None else None  # refused before any tick
        if resume:
            brain = sessions.resume(lm, session)
        elif dialogue is not None:
            try:
                first = dialogue.wait()
            except KeyboardInterrupt:
                raise typer.Exit(128 + int(signal.SIGINT)) from None
            if first is None:
                print("conversation mode: no line on stdin, nothing to answer", file=sys.stderr)
                return
            prompt_ids = dialogue.opening(first, system=prompt)
            if len(prompt_ids) + 1 > lm.max_positions:
                raise UserError(f"the first turn is {len(prompt_ids)} tokens, more than {lm.name}'s "
                                f"{lm.max_positions} positions")
            brain = Brain.start(lm, prompt_ids, config, pins=pin or ())
            if overwrite and session is not None:
                sessions.save(session, brain, lm.name)
        else:
            text = DEFAULT_PROMPT if prompt is None else prompt
            if (fewest := lm.fewest_tokens(text)) + 1 > lm.max_positions:  # before encoding: that alone took minutes
                raise UserError(f"the prompt is at least {fewest} tokens, more than {lm.name}'s "
                                f"{lm.max_positions} positions (a prompt must fit them; it is then pruned to the budget)")
            prompt_ids = [lm.bos_id] + lm.encode(text)
            brain = Brain.start(lm, prompt_ids, config, pins=pin or ())
            if overwrite and session is not None:  # at once, so that a resume after a crash cannot continue the old run
                sessions.save(session, brain, lm.name)
    if constraint is not None:
        brain.constraint = constraint  # the first reply's, or the run's
    if capture is not None:
        from ..fixtures import Capture

        brain.observers.append(Capture(capture, lm, capture_ticks))
    rounds = None
    if compile:
        from ..batch import Batch

        rounds = Batch(compiled=True, slots=1, texts=True)
    runner = Runner(brain, lm.name, None if ticks == -1 or dialogue else ticks, events=events, append_events=resume,
                    session=session, save_every=save_every, inputs=inputs, dialogue=dialogue, rounds=rounds)
    if compile:
        if (why := runner.refusal()) is not None:
            raise UserError(f"--compile: {why} (run without --compile)")
        compile_rounds(runner, lm, live)
    note = ctx.meta.get("policy_note")  # which default policy, and why (brain_config)
    if dialogue is not None:
        if note:
            print(note, file=sys.stderr)
        result = run_dialogue(brain, lm, runner, dialogue)
    elif not live:
        if note:
            print(note, file=sys.stderr)
        result = run_plain(brain, lm, runner, show_prompt=not resume)
    else:
        from ..tui.app import run_live

        result = run_live(brain, lm, runner, show_prompt=not resume, keys=fd if typing == "keys" else None)
        if note:  # after the view, where it stays on the screen
            print(note, file=sys.stderr)
    if result.interrupted:  # the summary says so; the exit code tells scripts (130 Ctrl-C, 143 SIGTERM)
        raise typer.Exit(128 + int(result.signal or signal.SIGINT))


def compile_rounds(runner: Runner, lm, live: bool) -> None:
    """Make the compiled round before the first tick, saying so (it takes a while)."""
    said = (f"compiling {lm.name}'s decode round (torch.compile, once per process; for a 135M model on 2 cores "
            "about 40 s, a minute in bfloat16)")
    if live:
        from ..tui.app import loading

        with loading(lm.name, what=said):
            runner.warm()
        return
    print(f"positronic: {said} …", file=sys.stderr, flush=True)
    start = time.perf_counter()
    runner.warm()
    print(f"positronic: compiled in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def grammar_of(gbnf: str | None, gbnf_file: Path | None, schema: str | None, schema_file: Path | None):
    """The grammar the run's text keeps to (brain/grammar.py), or None; UserError for two at
    once, an unreadable file, or a grammar that cannot be read."""
    from ..brain.grammar import Grammar, GrammarError

    given = {name: value for name, value in (("--grammar", gbnf), ("--grammar-file", gbnf_file),
                                             ("--json-schema", schema), ("--json-schema-file", schema_file))
             if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise UserError(f"give one of {', '.join(given)}: each says what the whole text keeps to")
    (name, value), = given.items()
    if isinstance(value, Path):  # a file, or a pipe read like one (bounded: /dev/zero stops)
        try:
            value = read_text_file(value, name)
        except OSError as exc:
            raise UserError(str(exc)) from None
    try:
        return Grammar.gbnf(value) if "grammar" in name else Grammar.json_schema(value)
    except GrammarError as exc:
        raise UserError(f"{name}: {exc}") from None


def checked_constraint(grammar, lm):
    """`grammar` made ready for `lm`'s tokens; UserError when it cannot be used."""
    from ..brain.grammar import GrammarError

    try:
        return grammar.constraint(lm)
    except GrammarError as exc:
        raise UserError(str(exc)) from None


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



def stdin_is_terminal() -> bool:
    try:
        return os.isatty(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):  # no stdin, or one without a descriptor (pytest's)
        return True  # nothing to read lines from: never taken for a pipe of questions


def terminal_prompt() -> None:
    sys.stdout.write("> ")
    sys.stdout.flush()


def chat_template_text(value: str) -> str:
    """--chat-template's Jinja text ("" for plain): a name, a file, or a template itself."""
    if value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[value]
    if "{{" not in value and "{%" not in value:
        path = Path(value)
        if not path.is_file():
            raise UserError(f"--chat-template {value!r} is not a template name ({', '.join(CHAT_TEMPLATES)}), "
                            "a file, or a Jinja template")
        try:
            value = read_text_file(path, "--chat-template")
        except OSError as exc:
            raise UserError(str(exc)) from None
    try:
        import jinja2

        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"--chat-template: the Jinja template does not parse: {exc.message} (line {exc.lineno})") from None
    return value


def run_dialogue(brain: Brain, lm, runner: Runner, dialogue: Dialogue) -> RunResult:
    """Conversation mode: each reply's text to stdout (a line break after it), the summary to
    stderr at the end of the input."""
    out = sys.stdout

    def on_tick(record: TickRecord, result: RunResult) -> None:
        if dialogue.shown:
            out.write(record.text)
        if dialogue.ended:
            out.write("\n")
        out.flush()

    result = runner.run(on_tick)
    sys.stderr.write(summary(brain, lm, result) + f"\nreplies {dialogue.replies}\n")
    return result


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
            err.write(progress_line(runner.sync(), record, result, runner.ticks) + "\n")

    result = runner.run(on_tick)
    out.write("\n" + summary(brain, lm, result) + "\n")
    return result


def progress_line(brain: Brain, record: TickRecord, result: RunResult, total: int) -> str:
    c = brain.counts
    union = f" per layer, {record.live_tokens} tokens" if record.live_tokens != record.live_length else ""
    return (f"[{result.ticks}/{total or '∞'}] tick {record.tick}  live {record.live_length}/{brain.config.budget}{union}  "
            f"{result.ticks / result.seconds:.1f} tok/s  repairs {c['repairs']}  culls {c['culls']}  "
            f"rebuilds {c['rebuilds']}  {shading(brain)}")


def shading(brain: Brain) -> str:
    """What the live view colours tokens by (tui.snapshot.shades), least/mean/most over the live
    tokens: `brightness 0/68/255`, or under SmartKV `held by 1/36/90 of 90 kv heads`."""
    values, scale, measure = shades(brain, brain.state.lm.num_layers)
    spread = f"{min(values):.0f}/{sum(values) / len(values):.0f}/{max(values):.0f}"
    return f"brightness {spread}" if measure == "brightness" else f"held by {spread} of {scale:.0f} {measure}"

