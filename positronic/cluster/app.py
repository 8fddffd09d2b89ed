"""`positronic serve --replicas N`: the server as a Ray Serve application.

    Ray Serve's HTTP proxy (--host, --port)
        -> Front (front.py): one deployment; reads each request's session, picks its replica
           (routes.py), relays the answer
        -> Replica 0 .. N-1 (replica.py): one deployment each, a whole server (its model, its
           sessions in memory, its batched engine), restarted by Ray when it dies
    the store: one session directory that every replica reaches (cli/serve.py checks it);
    a session is held by one replica at a time (its lock in the store)

A local Ray instance is started for the command (or `--ray-address` joins a running cluster);
Ctrl-C or SIGTERM deletes the application, which stops every replica's server the way a Ctrl-C
stops a plain one (every session checkpointed), then stops Ray if this command started it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

APP_NAME = "positronic"
OBJECT_STORE_BYTES = 256 << 20  # a local instance: the replicas exchange addresses, not tensors, through Ray
# a local instance shares its CPUs with the replicas' model loads and forwards: Ray's controller kills a
# proxy not ready in 5 s (its default), which on a loaded 2-core box failed a start (`serve.start`:
# ActorDiedError); the processes of a local instance read these from this one's environment, and a
# value already set there is kept
LOCAL_RAY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def replica_names(count: int) -> list[str]:
    return [f"replica-{index}" for index in range(count)]


def bind(spec, replicas: int, cpus: float, gpus: float):
    """The application: the front bound to `replicas` replica deployments of `spec`."""
    from .front import Front
    from .replica import Replica

    handles = {name: Replica.options(name=name, ray_actor_options={"num_cpus": cpus, "num_gpus": gpus}).bind(spec, name)
               for name in replica_names(replicas)}
    return Front.options(name="front").bind(handles, spec.settings.max_body_bytes, spec.api_key)


def serve_cluster(spec, *, replicas: int, host: str, port: int, ray_address: str | None, cpus: float,
                  gpus: float) -> int:
    """Runs the application until Ctrl-C or SIGTERM; the exit status (0, or 1 if it failed)."""
    import ray
    from ray import serve

    stop = threading.Event()
    previous = {}
    local = ray_address is None
    try:
        if local:  # enough CPUs declared for every replica's threads, whatever this machine has
            for name, value in LOCAL_RAY_ENV.items():
                os.environ.setdefault(name, value)
            ray.init(num_cpus=max(os.cpu_count() or 1, int(replicas * cpus)), include_dashboard=False,
                     object_store_memory=OBJECT_STORE_BYTES, logging_level=logging.WARNING,
                     namespace=APP_NAME)
        else:
            ray.init(address=ray_address, logging_level=logging.WARNING, namespace=APP_NAME)
        serve.start(http_options={"host": host, "port": port})
        serve.run(bind(spec, replicas, cpus, gpus), name=APP_NAME, route_prefix="/", blocking=False)
        # taken after Ray's start-up, which installs handlers of its own
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        shown = f"[{host}]" if ":" in host else host
        print(f"positronic serve running on http://{shown}:{port} ({replicas} replicas on Ray"
              f"{f' at {ray_address}' if ray_address else ', a local instance'}; sessions in "
              f"{spec.settings.session_dir})", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
        print("stopping: every replica checkpoints its sessions", file=sys.stderr, flush=True)
        return stop_application(serve)
    except (RuntimeError, ray.exceptions.RayError) as exc:  # a replica that cannot start, a cluster not reached
        print(f"error: the cluster did not start: {why_not_started(serve) or exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ray.is_initialized():
            if local:
                serve.shutdown()
            ray.shutdown()


def why_not_started(serve) -> str | None:
    """The first failed deployment's own error (its exception's last line, as a replica's
    constructor raised it: "ModelError: cannot load model …"), or None."""
    try:
        application = serve.status().applications.get(APP_NAME)
    except Exception:  # noqa: BLE001 -- Ray itself is what failed: its message is the one to show
        return None
    for name, deployment in sorted((application.deployments if application else {}).items()):
        lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
        if deployment.status != "HEALTHY" and lines:
            return f"{name}: {lines[-1]}"
    return None


STOP_WAIT_S = 180  # past the replicas' graceful period (replica.py: 60 s), which Ray enforces by killing them


def stop_application(serve) -> int:
    """Deletes the application and waits for it to go: each replica's server stops as a plain
    one does (sessions checkpointed). Ray kills one that is still not stopped after its graceful
    period (one still starting, say): nothing answered is lost then either, as every answer was
    checkpointed before its last byte; said in a line. 0, or 1 if the application would not go."""
    import time

    serve.delete(APP_NAME, _blocking=False)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        if APP_NAME not in serve.status().applications:
            return 0
        time.sleep(0.5)
    print(f"error: the application did not stop within {STOP_WAIT_S} s (every answered turn was checkpointed "
          "before its answer; sessions in the middle of a request may have lost that request)", file=sys.stderr,
          flush=True)
    return 1
