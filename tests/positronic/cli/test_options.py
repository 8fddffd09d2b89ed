"""Every option of every command, walked with hostile values (issue 75): each value is refused
with one `error:` line naming the option, exit code 2, no traceback and nothing left on disk,
or it is honoured, and then listed in ALLOWED with the reason.

The options come from the commands' own definitions (typer's click commands, and `smartkv
train`'s argparse parser), so a new option is walked without a new test. Each command runs in
this process with the tmp directory as its working directory and `--model` an empty directory
(UNLOADABLE): a value that passes every check reaches the model load, which fails there with
the one error that says so. That is what "honoured" means here: no check refused the value,
and no check can be left for after a model has loaded (a refusal after a load costs minutes
on a real model, and a server would already be serving).
"""

from __future__ import annotations

import os
import threading
import typing
from pathlib import Path

import pytest
import typer.main

from positronic.cli import app

UNLOADABLE = "unloadable-model"
NUMBERS = ("-1", "0", str(2**63), str(2**64), "nan", "inf", "-1e309", "x")
PATHS = ("FIFO", "DIR", "/dev/zero", "FILE")
WORDS = ("bogus", "FIFO", "DIR")
TEXT = ("The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 20)  # 1,380 bytes

# The arguments each command is walked with (the walked option comes after them, so it wins).
BASE = {
    "run": ["run", "--model", UNLOADABLE, "-n", "1", "--no-tui", "--no-input"],
    "eval": ["eval", "--model", UNLOADABLE, "--text", "t.txt", "--out", "out"],
    "serve": ["serve", "--model", UNLOADABLE, "--session-dir", "sessions", "--port", "0"],
    "replay": ["replay"],
    "smartkv": ["smartkv", "train", "--model", UNLOADABLE, "--text", "t.txt", "--heldout", "h.txt",
                "--out", "g.safetensors"],
}
# Options that only one mode of their command reads: walked in that mode (given to the
# other, each is refused as unread, whatever its value: eval's own tests check that).
CONTEXT = {("eval", "prompt_tokens"): ["--generate", "4"], ("eval", "seed"): ["--generate", "4"],
           ("run", "capture_ticks"): ["--capture", "captures"], ("run", "save_every"): ["--session", "session"]}

# Honoured values: (command, option) -> (values, why). Everything else must be refused.
_N = "a count of 0 is meaningful here"
HUGE = {str(2**63), str(2**64)}  # Python ints, only compared or used to cut: "all" 
ALLOWED = {
    # run (and serve, which takes the run's definitions and checks: the same entries)
    ("run", "ticks"): ({"-1"}, "-1 is no tick limit (Ctrl-C ends the run)"),
    ("run", "prompt"): ({"bogus", "FIFO", "DIR"}, "any text is a prompt"),
    ("run", "prompt_file"): ({"FIFO", "FILE"}, "a file, or a pipe read like one (a FIFO waits for its writer, "
                                              "which the walk starts)"),
    ("run", "sinks"): ({"0"}, _N), ("run", "protect"): ({"0"}, _N), ("run", "window"): ({"0"}, _N),
    ("run", "unit"): ({"0"}, "0 is automatic: pairs with a repairer, rows without"),
    ("run", "top_k"): ({"0"}, "0 turns top-k off"), ("run", "seed"): ({"0"}, "a seed"),
    ("run", "min_p"): ({"0"}, "0 turns min-p off"),
    ("run", "presence_penalty"): ({"-1", "0"}, "OpenAI's range is -2..2"),
    ("run", "frequency_penalty"): ({"-1", "0"}, "OpenAI's range is -2..2"),
    ("run", "refresh_every"): ({"0"}, "0 never refreshes"),
    ("run", "evict_every"): ({"0"}, "0 keeps each policy's own batch"),
    ("run", "refresh_kl"): ({"0", str(2**63), str(2**64)}, "0 is off; a finite threshold no KL reaches never "
                                                           "rebuilds, as asked"),
    ("run", "temperature"): ({"0", str(2**63), str(2**64)}, "0 is greedy; a huge temperature samples uniformly"),
    ("run", "ttl_decay"): ({"0", str(2**63), str(2**64)}, "the ttl rule's constants: any finite rate"),
    ("run", "ttl_gain"): ({"0", str(2**63), str(2**64)}, "the ttl rule's constants: any finite rate"),
    ("run", "bridge_margin"): ({"0", str(2**63), str(2**64)}, "nats a kept token must win by: a huge margin "
                                                              "never bridges"),
    ("run", "kv_eviction"): ({"0"}, "0 is llama.cpp's none"),
    ("run", "kv_sink_tokens"): ({"0"}, _N), ("run", "kv_protected_tokens"): ({"0"}, _N),
    ("run", "n_gpu_layers"): ({"0"}, "llama.cpp's -ngl 0: the CPU"),
    ("run", "session"): ({"DIR"}, "a new session in an empty directory"),
    ("run", "capture"): ({"DIR"}, "fixtures go into a directory"),
    # eval
    ("eval", "text"): ({"FIFO", "FILE"}, "a file, or a pipe read like one"),
    ("eval", "out"): ({"DIR"}, "results go into a directory"),
    ("eval", "protect"): ({"0"}, _N), ("eval", "sinks"): ({"0"}, _N),
    ("eval", "max_tokens"): (HUGE, "at most this many: the whole text"),
    ("eval", "segments"): (HUGE, "at most one per scored token"),
    ("eval", "smooth"): (HUGE, "the plot's window, cut to the tokens there are"),
    ("eval", "probe_at"): ({"0"}, "the fact first"),
    ("eval", "probe_filler"): ({"0"}, "a probe without filler"),
    ("eval", "seed"): ({"0"}, "a seed"),
    ("eval", "evict_every"): ({"0"}, "0 keeps each policy's own batch"),
    # serve: its own options
    ("serve", "port"): ({"0"}, "0 is any free port, printed"),
    ("serve", "session_dir"): ({"DIR"}, "sessions go into a directory"),
    ("serve", "idle_save"): ({"0", "inf"} | HUGE, "0 saves only when room is needed; an idle time never reached "
                                                  "(inf included: it is only compared) never saves"),
    ("serve", "max_sessions"): (HUGE, "a limit never reached: memory bounds the sessions made"),
    ("serve", "max_pending"): (HUGE, "a queue that is never full"),
    ("serve", "max_body"): (HUGE, "a body limit no request reaches"),
    ("serve", "max_tokens"): (HUGE, "a limit never reached: a request's own max_tokens and the positions bound it"),
    ("serve", "api_key"): ({"bogus", "FIFO", "DIR"}, "any printable word is a key"),
    ("serve", "served_model_name"): ({"bogus", "FIFO", "DIR"}, "any non-empty word names the model"),
    # smartkv train
    ("smartkv", "text"): ({"FIFO", "FILE"}, "a file, or a pipe read like one"),
    ("smartkv", "heldout"): ({"FIFO"}, "a file, or a pipe read like one"),
    ("smartkv", "max_tokens"): (HUGE, "at most this many: the whole text"),
    ("smartkv", "epochs"): (HUGE, "as long as asked, as --ticks -1 runs"),
    ("smartkv", "batch"): (HUGE, "one batch of every label"),
    ("smartkv", "lr"): ({str(2**63), str(2**64)}, "a finite rate; a run that diverges is refused before the gates "
                                                  "are written (test_train.py)"),
    ("smartkv", "seed"): ({"0"}, "a seed"),
    ("smartkv", "save_labels"): ({"FILE"}, "replaced, as --out is"),
}
SERVE_SHARED = {"run"}  # serve's run options are checked as the run's: the same allowances
PIPES = {("run", "prompt_file"), ("eval", "text"), ("smartkv", "text"), ("smartkv", "heldout"),
         ("run", "grammar_file"), ("run", "json_schema_file")}


def click_options(name: str):
    """(option name, its flags, kind) of a typer command, kind in number / path / word;
    flags (no value) and --help left out."""
    command = typer.main.get_command(app).commands[name]
    for param in command.params:
        kind = param.type_descriptor.annotation  # Optional[X] comes unwrapped; list[X] (repeatable) does not
        kind = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
        if getattr(param, "is_flag", False) or kind is bool:
            continue
        flags = list(param.opts) + list(getattr(param, "secondary_opts", []))
        yield param.name, flags, "argument" if param.param_type_name == "argument" else \
            "number" if kind in (int, float) else "path" if kind is Path else "word"


def smartkv_options():
    from positronic.smartkv.__main__ import parser

    train = parser()._subparsers._group_actions[0].choices["train"]
    for action in train._actions:
        if not action.option_strings or action.nargs == 0:  # --help, --per-head
            continue
        kind = "number" if action.type in (int, float) else "path" if action.type is Path else "word"
        yield action.dest, list(action.option_strings), kind


def cases():
    for command in ("run", "eval", "serve", "replay"):
        for name, flags, kind in click_options(command):
            for value in {"number": NUMBERS, "path": PATHS, "word": WORDS, "argument": PATHS}[kind]:
                yield command, name, flags, kind, value
    for name, flags, kind in smartkv_options():
        for value in {"number": NUMBERS, "path": PATHS, "word": WORDS}[kind]:
            yield "smartkv", name, flags, kind, value


def allowed(command: str, name: str, value: str) -> bool:
    owners = [command] + (["run"] if command == "serve" else [])
    return any(value in ALLOWED.get((owner, name), ((), ""))[0] for owner in owners)


def files(root: Path) -> set[str]:
    return {str(path.relative_to(root)) for path in root.rglob("*")}


class FifoWriter:
    """Writes `text` into the FIFO once a reader opens it; released if none ever does."""

    def __init__(self, fifo: Path, text: str):
        self.fifo = fifo
        self.thread = threading.Thread(target=self._write, args=(text,), daemon=True)
        self.thread.start()

    def _write(self, text: str) -> None:
        try:
            with open(self.fifo, "w") as pipe:  # waits for a reader
                pipe.write(text)
        except BrokenPipeError:
            pass

    def close(self) -> None:
        if self.thread.is_alive():  # nobody read it: open and drop the reading end to release the writer
            os.close(os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK))
        self.thread.join(10)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text(TEXT)
    (tmp_path / "h.txt").write_text(TEXT.upper())
    (tmp_path / UNLOADABLE).mkdir()
    (tmp_path / "DIR").mkdir()
    os.mkfifo(tmp_path / "FIFO")
    monkeypatch.delenv("POSITRONIC_API_KEY", raising=False)
    return tmp_path


@pytest.mark.long  # 830 commands, ~25 s: in make test, not in make test-fast
def test_every_option_is_refused_in_one_line_or_honoured(workdir, capsys, run_cli):
    pytest.importorskip("fastapi")  # serve is walked with its extra installed
    capsys.readouterr()
    problems, walked = [], 0
    for command, name, flags, kind, value in cases():
        walked += 1
        argument = "t.txt" if value == "FILE" else value
        args = BASE[command] + CONTEXT.get((command, name), []) + \
            ([argument] if kind == "argument" else [flags[-1], argument])
        before = files(workdir)
        writer = FifoWriter(workdir / "FIFO", TEXT) if value == "FIFO" and (command, name) in PIPES else None
        try:
            code = run_cli(*args)
        finally:
            if writer is not None:
                writer.close()
        out, err = capsys.readouterr()
        lines = err.splitlines()
        honoured = code == 2 and len(lines) == 1 and lines[0].startswith(f"error: cannot load model '{UNLOADABLE}'")
        named = [argument] if kind == "argument" else flags + [name, name.replace("_", "-")]
        refused = (code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and not honoured
                   and any(word in lines[0] for word in named))
        left = files(workdir) - before
        want = "honoured" if allowed(command, name, value) else "refused"
        got = "honoured" if honoured else "refused" if refused else f"exit {code}"
        if got != want or left or "Traceback" in err:
            problems.append(f"{command} {' '.join(args[len(BASE[command]):])}: {got}, want {want}"
                            + (f", left {sorted(left)}" if left else "") + f": {err.strip()[-300:]!r}")
    assert walked > 400
    assert not problems, f"{len(problems)} of {walked}:\n" + "\n".join(problems)


def test_the_allowances_name_options_that_exist():
    """An entry for an option that was renamed or removed would allow nothing, silently."""
    known = {(command, name) for command, name, *_ in cases()}
    assert set(ALLOWED) <= known, set(ALLOWED) - known
