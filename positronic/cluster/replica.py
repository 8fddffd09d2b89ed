"""One replica: a whole `positronic serve` (its model, its sessions, its batched state) inside a
Ray Serve deployment.

The replica runs the plain server unchanged (server/app.py's app under the same uvicorn server,
in a thread of the replica's process) on an address of its node, and tells the front where
(`url`). The front talks HTTP to it, so every rule of the plain server (sessions, their locks in
the store, checkpoints before an answer's last byte, Idempotency-Key) holds as it is. Ray's part
is the process: placing it (a GPU each with `--device cuda`), restarting it when it dies, and
stopping it, which checkpoints its sessions as a Ctrl-C does.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import uvicorn
from ray import serve

from ..server.app import GRACEFUL_S, GracefulServer, create_app
from .store import SessionStore, StoreSync

START_TIMEOUT_S = 600  # a model load (first-use gates included) may take minutes; Ray's own limit is longer


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica needs to make the server `serve` would make (cli/serve.py checked it all)."""

    model: str
    device: str | None
    dtype: str | None
    weights: str | None
    config: object  # BrainConfig
    settings: object  # ServerSettings: every replica's session_dir is the shared store
    gate_free: tuple | None = None  # (BrainConfig, note): the default's fallback where gates cannot be trained
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    log_level: str = "info"
    host: str = "127.0.0.1"  # where the replica listens: loopback on one machine; "": its node's address (a cluster)
    environment: dict = field(default_factory=dict)  # e.g. POSITRONIC_CACHE, as the command had it
    store: str | None = None  # an object store's URL: sessions pulled from and pushed to it (store.py)


class ReplicaServer(GracefulServer):
    """The plain server's shutdown without its "running on" line: a replica says where it runs in
    its own words, so that the cluster's address is the one line of the command that says so."""

    async def startup(self, sockets=None) -> None:
        await uvicorn.Server.startup(self, sockets)


@serve.deployment(max_ongoing_requests=1000, health_check_period_s=2, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=60)
class Replica:
    """The server of one replica (see the module's text)."""

    def __init__(self, spec: ReplicaSpec, name: str):
        import torch

        from ..cli.common import resolve_gates, set_threads
        from ..models import load_model

        os.environ.update(spec.environment)
        self.name = name
        logging.getLogger("positronic").setLevel(getattr(logging, spec.log_level.upper()))
        threads = spec.settings.threads or torch.get_num_threads()
        set_threads(1)  # the forward thread takes `threads`; this process's other threads keep to one (serve's rule)
        lm = load_model(spec.model, device=spec.device, dtype=spec.dtype, weights=spec.weights)
        config, note = resolve_gates(lm, spec.config, spec.gate_free)
        if note:
            print(f"{name}: {note}", file=sys.stderr, flush=True)
        import dataclasses

        settings = dataclasses.replace(spec.settings, threads=threads)
        self.work = None
        if spec.store is not None:  # the server's sessions in a local directory, the store's copy the truth
            self.work = Path(tempfile.mkdtemp(prefix=f"positronic-{name}-"))
            settings = dataclasses.replace(settings, session_dir=self.work)
        app = create_app(lm, config, settings, api_key=spec.api_key, cors_origins=spec.cors_origins)
        if spec.store is not None:
            store = SessionStore(spec.store, self.work, holder=f"{name}:{os.getpid()}")
            app = StoreSync(app, store, app.state.server, api_key=spec.api_key)
        host = spec.host or ray.util.get_node_ip_address()  # "": this node's address, which the front can reach
        # uvicorn's own lines at warning and above: its "running on" (and the access log) would be read for the
        # cluster's address by whoever watches the command's stderr, where Ray forwards every replica's lines
        level = spec.log_level if spec.log_level in ("critical", "error", "warning") else "warning"
        self.server = ReplicaServer(uvicorn.Config(app, host=host, port=0, log_level=level, access_log=False,
                                                   timeout_graceful_shutdown=GRACEFUL_S))
        self.thread = threading.Thread(target=self.server.run, name=f"{name}-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the server did not start (see the lines above)")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.address = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        # Ray forwards a replica's stderr to the command's, each line under the replica's name
        print(f"{name} serves at {self.address} (pid {os.getpid()}, {lm.name}, policy {config.policy})",
              file=sys.stderr, flush=True)

    def url(self) -> str:
        return self.address

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> None:
        """Ray restarts a replica whose server stopped (its thread ended, or it began shutting down)."""
        if not self.thread.is_alive() or self.server.should_exit:
            raise RuntimeError(f"{self.name}: its server has stopped")

    def __del__(self):
        """Stopped by Ray (the app deleted, the cluster shut down): the server's own shutdown,
        which checkpoints every session."""
        server = getattr(self, "server", None)
        if server is not None and self.thread.is_alive():
            server.should_exit = True
            self.thread.join()
        if getattr(self, "work", None) is not None:  # every session is in the store by now
            shutil.rmtree(self.work, ignore_errors=True)

