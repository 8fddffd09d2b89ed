"""`positronic serve --replicas 2` on a local Ray instance (positronic/cluster/): sessions spread
over the replicas and stay put; one replica holds a session at a time; a killed replica's
sessions resume on the other from the store, token for token; the failover soak; the flags
refused before anything starts; the plain server without Ray."""

import importlib.util
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.positronic.server.test_kill_soak import CONFIG, MODEL, SERVE_ARGS, Client, converse, sessions_said

ROOT = Path(__file__).resolve().parents[3]
KILLS = int(os.environ.get("POSITRONIC_CLUSTER_SOAK_KILLS", "20" if os.environ.get("POSITRONIC_LONG_TESTS") else "3"))
TURNS = 4 * KILLS  # requests per client: the kills land among them
SEED = int(os.environ.get("POSITRONIC_CLUSTER_SOAK_SEED", "5"))
REPLICA = "x-positronic-replica"

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed (pip install 'positronic-brain[cluster]')")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Cluster:
    """`run.py serve --replicas 2` as a process; its stderr in a file (its address, Ray's lines)."""

    def __init__(self, directory: Path, log: Path, *args: str):
        self.directory, self.log = directory, log
        command = [sys.executable, str(ROOT / "run.py"), "serve", "-m", MODEL, "--replicas", "2", "--port",
                   str(free_port()), "--session-dir", str(directory), *SERVE_ARGS, *args]
        with open(log, "w") as err:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        deadline = time.monotonic() + 300  # a busy 2-core box (the suite beside it) starts Ray slowly
        while not (found := re.search(r"serve running on (http://\S+) \(\d+ replicas", log.read_text())):
            assert self.process.poll() is None, f"serve exited {self.process.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the cluster did not start: {log.read_text()[-3000:]}"
            time.sleep(0.1)
        self.url = found.group(1)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=30).json()

    def pid(self, replica: str, timeout: float = 120) -> int:
        """The live process of `replica` (after a kill: the one Ray started again)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.health()["replicas"][replica]
            if entry["up"] and "pid" in entry:
                return entry["pid"]
            time.sleep(0.2)
        raise AssertionError(f"{replica} did not come back: {self.health()}")

    def kill(self, replica: str) -> int:
        pid = self.pid(replica)
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                return self.process.wait(240)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


STORES = ["directory", "object-store"]  # a shared directory (locks), an fsspec URL (leases, local copies)


@pytest.fixture
def cluster(tmp_path):
    made = []

    def start(store: str = "directory", *args: str) -> Cluster:
        """The cluster on a shared directory, or on an object store (fsspec's file:// as the store)."""
        if store == "object-store":
            args = ("--session-store", f"file://{tmp_path / 'objects'}", *args)
        made.append(Cluster(tmp_path / "store", tmp_path / f"cluster-{len(made)}.log", *args))
        made[-1].root = tmp_path / ("objects" if store == "object-store" else "store")  # where checkpoints land
        return made[-1]

    yield start
    for each in made:
        each.stop()


def ask(url: str, session: str, prompt: str, key: str | None = None, auth: dict | None = None,
        **extra) -> httpx.Response:
    body = {"model": MODEL, "user": session, "prompt": prompt, "max_tokens": 6, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120,
                      headers={**({"Idempotency-Key": key} if key else {}), **(auth or {})})


def in_memory(metrics_url: str, auth: dict | None = None) -> set[str]:
    """The sessions a replica holds, from its own metrics (one live-length gauge per session)."""
    text = httpx.get(metrics_url, timeout=30, headers=auth or {}).text
    return set(re.findall(r'positronic_live_length\{session="([^"]+)"\}', text))


@needs_ray
@pytest.mark.long
@pytest.mark.parametrize("store", STORES)
def test_sessions_stay_on_their_replica_one_holds_each_and_a_killed_ones_resume_exactly(store, cluster, live_server,
                                                                                        tiny, server_settings, tmp_path):
    sessions = [f"s{i}" for i in range(8)]
    prompts = [" one", " two", " three", " four"]
    with live_server(tiny, server_settings(tmp_path / "reference"), CONFIG) as plain:  # the uninterrupted run
        expected = {sid: [ask(plain.url, sid, p).json()["choices"][0]["text"] for p in prompts] for sid in sessions}
        transcripts = {sid: plain.get(f"/v1/sessions/{sid}").json()["transcript"] for sid in sessions}

    # the object-store cluster serves with an API key too: the replicas check it, and the front's own endpoints
    auth = {"Authorization": "Bearer k-123"} if store == "object-store" else {}
    served = cluster(store, *(("--api-key", "k-123") if auth else ()))
    replicas = {name: entry["url"] for name, entry in served.health()["replicas"].items()}
    # every session's requests go to one replica, and the sessions spread over both
    where: dict[str, set[str]] = {sid: set() for sid in sessions}
    for turn in range(2):
        for sid in sessions:
            answer = ask(served.url, sid, prompts[turn], key=f"{sid}-{turn}", auth=auth)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected[sid][turn]
            where[sid].add(answer.headers[REPLICA])
    assert all(len(names) == 1 for names in where.values()), where
    home = {sid: names.pop() for sid, names in where.items()}
    assert set(home.values()) == set(replicas), home
    for name, url in replicas.items():  # the replicas' own metrics agree: each holds only its sessions
        held = in_memory(f"{url}/metrics", auth)
        assert held and all(home[sid] == name for sid in held), (name, held, home)
        assert in_memory(f"{served.url}/replicas/{name}/metrics", auth) == held  # the same, through the front
    assert httpx.get(f"{served.url}/replicas/nope/metrics", headers=auth).status_code == 404
    if auth:  # without the key: the front's own endpoints and the replicas refuse, /health answers
        assert httpx.get(f"{served.url}/metrics").status_code == 401
        assert httpx.get(f"{served.url}/replicas/replica-0/metrics").status_code == 401
        assert ask(served.url, sessions[0], " no key").status_code == 401
        assert httpx.get(f"{served.url}/health").status_code == 200
    assert "positronic_cluster_requests_total" in httpx.get(f"{served.url}/metrics", headers=auth).text

    # one replica at a time: the other one, asked directly for a session the first holds, refuses
    # it and writes nothing
    victim = next(sid for sid in sessions if sid in in_memory(f"{replicas[home[sid]]}/metrics", auth))
    other = next(name for name in replicas if name != home[victim])
    saved = (served.root / victim / "mirror.msgpack").read_bytes()
    refused = ask(replicas[other], victim, " intruder", auth=auth)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_in_use", refused.text
    assert (served.root / victim / "mirror.msgpack").read_bytes() == saved

    # the replica holding it is killed: its sessions go on on the other, from the store, exactly
    lost = home[victim]
    served.kill(lost)
    for turn in range(2, 4):
        for sid in sessions:
            answer = ask(served.url, sid, prompts[turn], key=f"{sid}-{turn}", auth=auth)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected[sid][turn], (sid, turn)
            if turn == 2 and home[sid] == lost:
                assert answer.headers[REPLICA] != lost  # moved (Ray brings the killed one back meanwhile)
    for sid in sessions:
        assert httpx.get(f"{served.url}/v1/sessions/{sid}", timeout=30, headers=auth).json()["transcript"] == \
            transcripts[sid]
    assert served.health()["sessions_moved"] >= sum(1 for sid in sessions if home[sid] == lost)
    assert served.stop() == 0  # every replica stopped cleanly, its sessions checkpointed
    assert all((served.root / sid / "mirror.msgpack").exists() for sid in sessions)
    assert not list(served.root.glob("*/.lease")) and not list(served.root.glob("*/*.tmp"))  # all released, whole


@needs_ray
@pytest.mark.long
@pytest.mark.parametrize("store", STORES)
def test_replicas_killed_at_random_moments_lose_no_turn(store, cluster, live_server, tiny, server_settings, tmp_path):
    """The failover soak: 4 clients stream to their sessions (greedy and seeded sampled chats,
    completions) while replicas are killed by SIGKILL at random moments; every client retries what
    it did not get whole with its Idempotency-Key. Every answer and every transcript equals an
    uninterrupted run's."""
    def clients() -> list[Client]:
        rng = random.Random(SEED + 1)
        return [Client("greedy-chat", "chat", rng, TURNS), Client("sampled-chat", "sampled", rng, TURNS),
                Client("completions", "completion", rng, TURNS), Client("greedy-chat-2", "chat", rng, TURNS)]

    reference = clients()
    with live_server(tiny, server_settings(tmp_path / "reference"), CONFIG) as plain:
        converse(lambda: plain.url, reference, threading.Event())
        expected = sessions_said(plain.url, reference)
    assert not any(c.failures for c in reference), [c.failures for c in reference]

    served, soaked, stop, rng, kills = cluster(store), clients(), threading.Event(), random.Random(SEED), []
    talking = threading.Thread(target=converse, args=(lambda: served.url, soaked, stop))
    talking.start()
    try:
        while len(kills) < KILLS and talking.is_alive():
            time.sleep(rng.uniform(0.2, 1.5))
            up = {name: entry["pid"] for name, entry in served.health()["replicas"].items()
                  if entry["up"] and "pid" in entry}
            if up and talking.is_alive():  # none up: both are starting again, the clients retry meanwhile
                replica = rng.choice(sorted(up))
                os.kill(up[replica], signal.SIGKILL)
                kills.append(replica)
        talking.join(timeout=600)
        assert not talking.is_alive(), "the clients did not finish"
        for replica in ("replica-0", "replica-1"):  # a kill just before the clients finished: back first
            served.pid(replica)
        said = sessions_said(served.url, soaked)
    finally:
        stop.set()
        talking.join(timeout=60)
    assert kills, "no replica was killed: the clients finished first"
    assert not any(c.failures for c in soaked), [c.failures for c in soaked]
    for client, ref in zip(soaked, reference):
        assert client.answers == ref.answers, client.session
    assert said == expected
    assert served.stop() == 0
    print(f"cluster soak ({store}): {len(kills)} replicas killed ({', '.join(kills)}), {sum(c.attempts for c in soaked)} "
          f"requests for {sum(len(c.answers) for c in soaked)} answers ({sum(c.hung_up for c in soaked)} dropped by "
          "the clients); every answer and transcript equal to the uninterrupted run's")


@needs_ray
def test_what_a_cluster_cannot_do_is_refused_before_anything_starts(tmp_path, capsys, run_cli, monkeypatch):
    import positronic.cli.serve as serve_module

    monkeypatch.setattr(serve_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(serve_module, "serve_replicas", lambda *a, **k: pytest.fail("the cluster started"))
    store = ["--session-dir", str(tmp_path / "store")]
    assert run_cli("serve", "-m", MODEL, "--ray-address", "auto", *store) == 2
    assert "--ray-address is for a server on Ray: give --replicas 2 or more" in capsys.readouterr().err
    assert run_cli("serve", "-m", MODEL, "--replicas", "2", "--session-store", "memory://sessions", *store) == 2
    assert "a memory:// store lives in one process" in capsys.readouterr().err
    assert run_cli("serve", "-m", MODEL, "--replicas", "2", "--session-store", "nosuch://bucket/x", *store) == 2
    assert "--session-store 'nosuch://bucket/x': Protocol not known: nosuch" in capsys.readouterr().err
    if importlib.util.find_spec("s3fs") is None:  # the store's own package missing: named
        assert run_cli("serve", "-m", MODEL, "--replicas", "2", "--session-store", "s3://bucket/sessions", *store) == 2
        assert "s3fs" in capsys.readouterr().err
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    assert run_cli("serve", "-m", MODEL, "--replicas", "2", "--session-store", f"file://{not_a_directory}/x") == 2
    assert f"cannot write to --session-store file://{not_a_directory}/x" in capsys.readouterr().err
    assert run_cli("serve", "-m", MODEL, "--replicas", "2", "--checkpoint-when-idle", *store) == 2
    assert "--replicas needs --checkpoint-each-request" in capsys.readouterr().err
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if not os.access(read_only, os.W_OK):  # root writes anywhere
        assert run_cli("serve", "-m", MODEL, "--replicas", "2", "--session-store", f"file://{read_only}") == 2
        assert f"cannot use --session-store {read_only}: {read_only} is not writable" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()  # nothing made


def test_without_ray_replicas_name_the_extra_and_the_plain_server_never_imports_it(tmp_path, capsys, run_cli,
                                                                                  monkeypatch):
    import positronic.cli.serve as serve_module

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    monkeypatch.setattr(serve_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert run_cli("serve", "-m", MODEL, "--replicas", "2", "--session-dir", str(tmp_path)) == 2
    assert "--replicas needs ray: pip install 'positronic-brain[cluster]'" in capsys.readouterr().err
    code = ("import sys; import positronic.cli, positronic.cli.serve, positronic.server.app; "
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@needs_ray
def test_rays_own_tools_get_the_same_application_checked_as_serve_checks_it(tmp_path):
    """`serve run positronic.cli.cluster:application model=… replicas=2` (or a config file's
    import_path): the front over its replicas, with serve's checks and errors."""
    from ray.serve.deployment import Application

    from positronic.cli.cluster import application

    app = application({"model": MODEL, "replicas": "2", "budget": "96", "session_dir": str(tmp_path / "store"),
                       "engine": False})  # a switch off: --no-engine
    assert isinstance(app, Application)
    for args, said in [({"model": MODEL, "replicas": 1}, "replicas must be 2 or more"),
                       ({"model": MODEL, "replicas": 2, "budget": 3}, "--budget 3 leaves no room to cull"),
                       ({"model": MODEL, "replicas": 2, "bogus": 1}, "No such option: --bogus"),
                       ({"model": MODEL, "replicas": 2, "checkpoint_when_idle": True},
                        "--replicas needs --checkpoint-each-request")]:
        with pytest.raises(ValueError, match=re.escape(said)):
            application({"session_dir": str(tmp_path / "store"), **args})


@needs_ray
def test_a_local_instance_gives_rays_proxy_time_to_start_and_a_failed_start_is_one_line(capsys, monkeypatch):
    """A local instance's processes read Ray Serve's proxy timeouts from this process's
    environment: serve sets generous ones unless the user set them; Ray failing to start is
    a one-line error and exit 1, not a traceback."""
    import ray

    from positronic.cluster.app import LOCAL_RAY_ENV, serve_cluster

    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "")  # recorded, so that what serve sets is undone
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "7")  # the user's choice
    seen = {}

    def init(*args, **kwargs):  # where Ray would start its processes with this environment
        seen.update({name: os.environ.get(name) for name in LOCAL_RAY_ENV})
        raise ray.exceptions.RaySystemError("the raylet did not start")

    monkeypatch.setattr(ray, "init", init)
    assert serve_cluster(None, replicas=2, host="127.0.0.1", port=free_port(), ray_address=None, cpus=1, gpus=0) == 1
    assert seen == {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "7"}
    err = capsys.readouterr().err
    assert "error: the cluster did not start: " in err and "the raylet did not start" in err and "Traceback" not in err
