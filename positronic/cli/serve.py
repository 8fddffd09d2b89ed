"""The serve command: `positronic serve --model … --port 8080` (positronic/server/app.py).

Its maintenance and sampling options are the run's own definitions (`--policy`, `--budget`,
`--sinks`, `--protect`, the llama.cpp aliases, …), taken from the run command's signature
rather than copied, and they become a BrainConfig the way the run's do (`common.brain_config`);
only `--budget`'s default differs (a conversation needs more room than a first demo run).
The server's own options follow. Nothing here imports the HTTP stack: the command line loads
it only when the server starts.
"""

from __future__ import annotations

import copy
import enum
import errno
import inspect
import os
import re
import socket
from pathlib import Path
from typing import Callable, Optional

import typer

from ..brain.config import SERVE_BUDGET, check_budget
from ..models import load_model
from .common import UserError, freeze_heap, set_threads, with_gates, writable_directory

# the run's options a server takes as they are (besides --budget, whose default differs)
RUN_OPTIONS = ("model", "policy", "policy_option", "sinks", "protect", "window", "brightness", "ttl_decay", "ttl_gain", "unit",
               "repairer", "repair_tokens", "bridge_margin", "repair_batch", "recall", "at_capacity",
               "kv_eviction", "kv_sink_tokens", "kv_protected_tokens", "kv_format", "gates", "memory_rank", "reread",
               "temperature", "top_k",
               "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "refresh_every", "refresh_kl", "evict_every", "device", "dtype", "weights", "threads")


class LogLevel(str, enum.Enum):
    """uvicorn's log levels."""
    critical, error, warning, info, debug = "critical", "error", "warning", "info", "debug"


ORIGIN = re.compile(r"\*|[a-z][a-z0-9+.-]*://[^/\s]+")  # what a browser sends in Origin: no path, no slash


def _server_options(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (127.0.0.1: this machine only)."),
    port: int = typer.Option(8080, min=0, max=65535, help="Port to listen on (0: any free port, printed)."),
    session_dir: Optional[Path] = typer.Option(None, help="Where idle sessions are checkpointed (default: "
                                               "~/.cache/positronic/server-sessions/MODEL, or under $POSITRONIC_CACHE)."),
    max_sessions: int = typer.Option(16, min=1, help="Sessions kept in memory (throwaway ones included); the least "
                                     "recently used idle one is checkpointed to disk and freed to make room, "
                                     "and resumed on its next request."),
    idle_save: float = typer.Option(300.0, min=0.0, help="Checkpoint and free a session idle this many seconds "
                                    "(0: only when room is needed, and at shutdown)."),
    max_pending: int = typer.Option(64, min=1, help="Generation requests in the server at once, queued ones "
                                    "included; more are refused with 429."),
    max_body: int = typer.Option(1 << 20, min=1024, help="Largest request body in bytes (413 above)."),
    max_tokens: int = typer.Option(4096, min=1, help="The most tokens one request may ask to generate."),
    default_max_tokens: int = typer.Option(256, min=1, help="Tokens generated when a request gives no max_tokens."),
    history_edits: str = typer.Option(
        "refuse", help="A chat request whose earlier messages differ from its session's (an edited or regenerated "
                       "message): refuse (409 history_mismatch) | rebuild (start the session again from the request's "
                       "messages)."),
    engine: bool = typer.Option(
        True, "--engine/--no-engine",
        help="Run replies' ticks as rounds of Core v4's batched engine where a session's settings run there (its "
             "policy's press, shared rows; smartkv with --engine-smartkv; not repairers, 4-bit formats or the "
             "ring store yet), one engine of up to --max-sessions sequences (64 at most) per budget and kind of "
             "lanes; --no-engine: every tick a brain's own, its forward shared with the others'."),
    engine_smartkv: bool = typer.Option(
        False, "--engine-smartkv/--no-engine-smartkv",
        help="With --engine, SmartKV sessions (the embedded model's default) tick in engine rounds too. Off by "
             "default: on a 2-core CPU with SmolLM2 they made 0.68x the tokens/s of ticking alone (the forward "
             "bounds a round there); where the host bounds it (a GPU) try it on."),
    compile: bool = typer.Option(
        False, "--compile/--no-compile",
        help="With --engine, each engine round's forward as one compiled graph (torch.compile; Llama-class "
             "models with float weights): the first round at each batch size (2, 4, 8, ...) compiles it, about "
             "5 s on a tiny model and 40 s on SmolLM2 on 2 CPU cores, then every round runs it (SmolLM2 on 2 "
             "cores: a round of 8 sequences 1.3-1.4x faster). Replies equal alone still; their tokens may part "
             "from the uncompiled ones at a near-tie (docs/core.md, \"A compiled round\")."),
    served_model_name: Optional[list[str]] = typer.Option(
        None, metavar="NAME",
        help="Model ids requests may name and answers carry (vLLM's flag: `--served-model-name a b`, or the flag "
             "repeated): the first is the one "
             "/v1/models lists first and /metrics labels. Default: the -m string."),
    checkpoint_each_request: bool = typer.Option(
        True, "--checkpoint-each-request/--checkpoint-when-idle",
        help="Write a session to disk at the end of each request, before its answer's last byte (a kill loses "
             "no answered turn; about one tick's time per request), or only when it is freed and at shutdown."),
    api_key: Optional[str] = typer.Option(
        None, envvar="POSITRONIC_API_KEY", metavar="KEY",
        help="Require `Authorization: Bearer KEY` on every request but GET /health (401 without it). The "
             "environment variable keeps the key out of the process list."),
    cors_origin: Optional[list[str]] = typer.Option(
        None, metavar="ORIGIN",
        help="A browser origin allowed to call the server (https://host[:port]; repeatable; *: any). None: no "
             "CORS headers."),
    replicas: int = typer.Option(
        1, min=1, max=256, help="Replicas of the server on Ray Serve behind this one address (2 or more; Ray installs with "
                       "`pip install 'positronic-brain[cluster]'`): each a whole server, a session's requests all go to "
                       "the replica holding it, and a replica that dies hands its sessions to another from the "
                       "store (docs/cluster.md). 1: the plain server, without Ray."),
    ray_address: Optional[str] = typer.Option(
        None, metavar="ADDRESS", help="With --replicas: join this Ray cluster (ray://host:10001, or auto) instead of "
                                      "starting a local instance."),
    session_store: Optional[str] = typer.Option(
        None, metavar="URL", help="With --replicas: the store every replica checkpoints its sessions to: a directory "
                                  "every node reaches (a path on shared storage; one replica per session by its "
                                  "lock there), or an object store's URL (s3://bucket/dir, gs://, file:///dir: any "
                                  "fsspec protocol; one replica per session by a lease; each replica works on a "
                                  "local copy). Default: --session-dir."),
    log_level: LogLevel = typer.Option(LogLevel.info, case_sensitive=False, help="Log level of uvicorn and the "
                                       "server (the address it runs on is printed at every level)."),
) -> None:
    """The serve command's own options: their definitions only (never called)."""


SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client")  # pyproject.toml's [serve] extra


def require_serve_extra() -> None:
    """UserError naming what to install when the HTTP stack is missing (the core install does
    not bring it), before anything slow happens."""
    import importlib.util

    if missing := [name for name in SERVE_EXTRA if importlib.util.find_spec(name) is None]:
        raise UserError(f"positronic serve needs {', '.join(missing)}: pip install 'positronic-brain[serve]'")


def default_session_dir(model: str) -> Path:
    """The checkpoint directory of a model's sessions: one per model, as a session resumes
    only with the model it was saved with."""
    from ..models import cache_root

    return cache_root() / "server-sessions" / re.sub(r"[^A-Za-z0-9._-]+", "_", model)


API_KEY_ENV = "POSITRONIC_API_KEY"


def check_access(api_key: str | None, origins: list[str]) -> None:
    """UserError for a key no client could send in a header, or an origin no browser sends
    (the key itself is never printed). An empty $POSITRONIC_API_KEY is refused too: click reads
    an empty variable as unset, and the server would start open to anyone by accident."""
    if api_key is None and os.environ.get(API_KEY_ENV) == "":
        raise UserError(f"${API_KEY_ENV} is set but empty: give a key, or unset it to serve without one")
    if api_key is not None and not (api_key and all("!" <= c <= "~" for c in api_key)):
        raise UserError("--api-key (or $POSITRONIC_API_KEY) must be printable ASCII without spaces, and not empty")
    for origin in origins:
        if not ORIGIN.fullmatch(origin):
            raise UserError(f"--cors-origin {origin!r} is not an origin: scheme://host[:port] without a path "
                            "(https://example.com), or *")


def check_address(host: str, port: int) -> None:
    """UserError unless the server can listen on host:port now: each address `host` names is
    bound for a moment (as uvicorn will bind it), so that a bad --host or a --port in use is
    one line before the model loads, not a failure after it."""
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError, ValueError) as exc:
        raise UserError(f"--host {host!r} is not an address of this machine "
                        f"({getattr(exc, 'strerror', None) or exc})") from None
    for family, kind, proto, _, address in found:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:  # a family this machine lacks (IPv6 off): asyncio's server skips it too
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server does
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                flag = f"--port {port}" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else f"--host {host!r}"
                raise UserError(f"cannot listen on {address[0]} port {port} ({flag}): {exc.strerror}") from None


def serve_command(run: Callable, brain_config: Callable) -> Callable:
    """The `serve` command function, with `run`'s options (RUN_OPTIONS and --budget) and the
    server's own as its signature; `brain_config(ctx, options)` makes the BrainConfig."""
    shared = inspect.signature(run, eval_str=True).parameters
    budget = copy.copy(shared["budget"].default)
    budget.default, budget.help = SERVE_BUDGET, "Live context budget of each session: never exceeded after a tick."
    parameters = [shared["ctx"]] + [shared[name].replace(default=budget) if name == "budget" else shared[name]
                                    for name in shared if name in RUN_OPTIONS or name == "budget"]
    parameters += list(inspect.signature(_server_options, eval_str=True).parameters.values())

    def serve(ctx: typer.Context, **options) -> int:
        """Serve the brain over HTTP until Ctrl-C or SIGTERM (sessions are saved on the way out)."""
        require_serve_extra()
        if options["history_edits"] not in ("refuse", "rebuild"):
            raise UserError(f"--history-edits must be refuse or rebuild, got {options['history_edits']!r}")
        if options["compile"] and not options["engine"]:
            raise UserError("--compile compiles the engine's rounds: give it without --no-engine")
        config = brain_config(ctx, options)
        directory = options["session_dir"] or default_session_dir(options["model"])
        store = None  # an object store's URL (--session-store s3://…): no directory of its own here
        if options["replicas"] > 1:
            directory, store = check_cluster(options, directory)
        elif options["ray_address"] is not None or options["session_store"] is not None:
            given = "--ray-address" if options["ray_address"] is not None else "--session-store"
            raise UserError(f"{given} is for a server on Ray: give --replicas 2 or more with it")
        if store is None:
            writable_directory(directory, "--session-store" if options["session_store"] else "--session-dir")
        if options["default_max_tokens"] > options["max_tokens"]:
            raise UserError(f"--default-max-tokens {options['default_max_tokens']} is above "
                            f"--max-tokens {options['max_tokens']}")
        check_access(options["api_key"], options["cors_origin"] or [])
        names = options["served_model_name"] or []
        if any(not name.strip() for name in names) or len(set(names)) != len(names):
            raise UserError(f"--served-model-name must be distinct, non-empty names, got {names}")
        check_address(options["host"], options["port"])
        from ..brain import session as sessions

        # one server per session directory (and no run.py on the directory itself; each session has its
        # own lock, held by the pool while the session is in memory): held until the command ends
        if store is None:  # (an object store is held session by session, by leases: cluster/store.py)
            ctx.with_resource(sessions.locked(directory, "positronic serve"))
        if options["replicas"] > 1:
            return serve_replicas(ctx, options, config, directory, store)
        import torch

        # the forwards run in the server's forward thread with these threads; this one (the event
        # loop's) keeps to one, so that it never starts OpenMP threads of its own, which would
        # slow every forward (positronic/batch/threads.py)
        threads = options["threads"] or torch.get_num_threads()
        set_threads(1)
        lm = load_model(options["model"], device=options["device"], dtype=options["dtype"], weights=options["weights"],
                        compiled=options["compile"])
        freeze_heap()
        config = with_gates(ctx, lm, config)  # --gates auto: kept, or trained now on first use
        check_budget(lm, config)
        if options["compile"]:
            from ..models.compiled import refusal

            if (why := refusal(lm)) is not None:
                raise UserError(f"--compile: {why}")
        if note := ctx.meta.get("policy_note"):  # which default policy, and why (common.brain_config)
            typer.echo(note, err=True)
        from ..server.app import serve_forever

        settings = server_settings(options, directory, threads)
        return serve_forever(lm, config, settings, host=options["host"], port=options["port"],  # exit status
                             api_key=options["api_key"], cors_origins=options["cors_origin"] or (),
                             log_level=options["log_level"].value)

    serve.__signature__ = inspect.Signature(parameters)
    return serve


def server_settings(options: dict, directory: Path, threads: int | None):
    """The ServerSettings of serve's options (a replica's too)."""
    from ..server.service import ServerSettings

    return ServerSettings(session_dir=directory, max_sessions=options["max_sessions"],
                                  idle_save_s=options["idle_save"], max_pending=options["max_pending"],
                                  max_body_bytes=options["max_body"], max_tokens=options["max_tokens"],
                                  default_max_tokens=options["default_max_tokens"],
                                  checkpoint_each_request=options["checkpoint_each_request"],
                                  history_edits=options["history_edits"], threads=threads,
                                  engine_slots=min(options["max_sessions"], 64) if options["engine"] else 0,
                                  engine_smartkv=options["engine_smartkv"],
                                  engine_compiled=options["compile"] and options["engine"],
                                  served_model_names=tuple(options["served_model_name"] or ()))


CLUSTER_EXTRA = ("ray",)  # pyproject.toml's [cluster] extra
# what a replica's process is given of this one's environment (a local instance inherits it all;
# a cluster's nodes have their own)
PASSED_ENVIRONMENT = ("POSITRONIC_CACHE", "POSITRONIC_NAN_FILL", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def check_cluster(options: dict, directory: Path) -> tuple[Path, str | None]:
    """UserError for what a server on Ray cannot do (before anything loads). The store: a
    directory (shared storage; `file:///path` too), or the URL of an object store (s3://, gs://,
    any other fsspec protocol but memory://), checked by writing to it."""
    import importlib.util

    if missing := [name for name in CLUSTER_EXTRA if importlib.util.find_spec(name) is None]:
        raise UserError(f"--replicas needs {', '.join(missing)}: pip install 'positronic-brain[cluster]'")
    if not options["checkpoint_each_request"]:
        raise UserError("--replicas needs --checkpoint-each-request: a replica that dies hands its sessions to "
                        "another from their checkpoints, which must hold every answered turn")
    store = options["session_store"]
    if store is None:
        return directory, None
    scheme, sep, _ = store.partition("://")
    if not sep:
        return Path(store), None
    if scheme == "memory":
        raise UserError(f"--session-store {store!r}: a memory:// store lives in one process, and every replica is a "
                        "process of its own; give a shared directory or an object store")
    try:
        import fsspec

        fs, root = fsspec.core.url_to_fs(store)
        probe = f"{root.rstrip('/')}/.positronic-probe-{os.getpid()}"
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except (ImportError, ValueError) as exc:  # a protocol fsspec does not know, or its package missing
        raise UserError(f"--session-store {store!r}: {exc}") from None
    except OSError as exc:
        raise UserError(f"cannot write to --session-store {store}: {exc.strerror or exc}") from None
    return directory, store


def serve_replicas(ctx: typer.Context, options: dict, config, directory: Path, store: str | None) -> int:
    """`serve --replicas N`: the server on Ray Serve (positronic/cluster/app.py)."""
    from ..cluster.app import serve_cluster
    from ..cluster.replica import ReplicaSpec

    replicas = options["replicas"]
    threads = options["threads"] or max(1, (os.cpu_count() or 1) // replicas)  # one machine's cores shared out
    port = options["port"] or free_port(options["host"])
    spec = ReplicaSpec(model=options["model"], device=options["device"], dtype=options["dtype"],
                       weights=options["weights"], config=config, settings=server_settings(options, directory, threads),
                       gate_free=ctx.meta.get("gate_free"), api_key=options["api_key"],
                       cors_origins=tuple(options["cors_origin"] or ()), log_level=options["log_level"].value,
                       host="127.0.0.1" if options["ray_address"] is None else "", store=store,
                       environment={name: os.environ[name] for name in PASSED_ENVIRONMENT if name in os.environ})
    gpus = 1.0 if (options["device"] or "").startswith("cuda") else 0.0
    if ctx.meta.get(PLAN_ONLY):  # cluster.app.application: Ray Serve runs it, this command does not
        ctx.meta[PLAN] = dict(spec=spec, replicas=replicas, cpus=float(threads), gpus=gpus)
        return 0
    return serve_cluster(spec, replicas=replicas, host=options["host"], port=port,
                         ray_address=options["ray_address"], cpus=float(threads), gpus=gpus)


PLAN_ONLY, PLAN = "positronic.cluster.plan_only", "positronic.cluster.plan"


def free_port(host: str) -> int:
    """A port free on `host` now (--port 0: Ray's proxy needs a number)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
