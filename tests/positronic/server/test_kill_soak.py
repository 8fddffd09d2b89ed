"""The server's kill soak: `positronic serve` killed again and again (SIGKILL or SIGTERM, at
random moments: mid-stream, mid-checkpoint, during start-up) while clients stream to their
sessions, restarted each time on the same session directory; every client retries what it did
not get whole with the same Idempotency-Key (positronic/server/answers.py).

At the end every client has received exactly the answers, and every session holds exactly the
transcript, of an uninterrupted reference run: greedy and seeded sampling alike, token for
token; no session lost, none corrupted, no duplicate or missing turn. Bounded: 4 kills in the
suite, 40 with POSITRONIC_LONG_TESTS=1 (POSITRONIC_SERVER_SOAK_KILLS, POSITRONIC_SERVER_SOAK_SEED; the long form's figures are in
bench/results/long_runs.md),
each printed with its outcome (pytest -s shows them).
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from positronic.brain.loop import BrainConfig

ROOT = Path(__file__).resolve().parents[3]
MODEL = "random:tiny"
KILLS = int(os.environ.get("POSITRONIC_SERVER_SOAK_KILLS", "40" if os.environ.get("POSITRONIC_LONG_TESTS") else "4"))
SEED = int(os.environ.get("POSITRONIC_SERVER_SOAK_SEED", "11"))  # the kills' moments and the clients' faults
TURNS = max(6, KILLS * 3 // 2)  # requests per client: the kills land among them
CONFIG = BrainConfig(budget=96, temperature=0.0, seed=0)  # serve's defaults, but these
# the first kills: one of each kind (the suite's short form makes only these four)
PLAN = [("checkpoint", signal.SIGKILL), ("traffic", signal.SIGTERM), ("start-up", signal.SIGKILL),
        ("traffic", signal.SIGKILL)]
SERVE_ARGS = ("--budget", "96", "--temperature", "0", "--seed", "0", "--max-sessions", "2", "-t", "1")


class Client:
    """One session's requests, each with its own key, sent until answered whole. Kinds: a
    greedy chat, a seeded sampled chat, greedy completions; streamed and whole in turn."""

    def __init__(self, session: str, kind: str, rng: random.Random, turns: int = TURNS):
        self.session, self.kind, self.rng, self.turns = session, kind, rng, turns
        self.answers: list[str] = []
        self.history: list[dict] = []
        self.attempts = 0  # requests sent, retries included
        self.hung_up = 0  # answers the client dropped (a timeout, a stream cut off)
        self.failures: list[str] = []

    def body(self, turn: int) -> tuple[str, dict]:
        if self.kind == "completion":
            body = {"prompt": f" step {turn}:", "max_tokens": 8 + 5 * (turn % 4), "ignore_eos": True}
            return "/v1/completions", {"model": MODEL, "user": self.session, **body}
        said = self.history + [{"role": "user", "content": f"tell me about {turn}"}]
        body = {"model": MODEL, "user": self.session, "messages": said, "max_tokens": 6 + 4 * (turn % 3)}
        if self.kind == "sampled":
            body.update(temperature=0.9, top_p=0.95, seed=1234)
        return "/v1/chat/completions", body

    def run(self, url: "callable", stop: threading.Event) -> None:
        for turn in range(self.turns):
            path, body = self.body(turn)
            key, streamed = f"{self.session}-{turn}", turn % 2 == 0
            while not stop.is_set() and not self.failures:
                answer = self.ask(url(), path, body, key, streamed)
                if answer is not None:
                    break
                time.sleep(self.rng.uniform(0.02, 0.2))
            else:
                return  # stopped, or a request was refused: the test reports it
            self.answers.append(answer)
            if self.kind != "completion":
                self.history += [body["messages"][-1], {"role": "assistant", "content": answer}]

    def ask(self, url: str | None, path: str, body: dict, key: str, streamed: bool) -> str | None:
        """The answer's text if it came whole, None if it must be asked again."""
        if url is None:  # the server is restarting
            return None
        self.attempts += 1
        headers = {"Idempotency-Key": key}
        # a quarter of the attempts lose their answer on the client's side (a network fault): a
        # whole reply times out, a stream is dropped after a few events
        lost = self.rng.random() < 0.25
        try:
            if not streamed:
                timeout = self.rng.uniform(0.005, 0.3) if lost else 60
                response = httpx.post(url + path, json=body, headers=headers, timeout=timeout)
                if response.status_code in (429, 503):
                    return None
                if response.status_code != 200:
                    self.failures.append(f"{key}: {response.status_code} {response.text[:300]}{self.mismatch(url, response)}")
                    return None
                choice = response.json()["choices"][0]
                return choice["text"] if "text" in choice else choice["message"]["content"]
            text, finished, done = "", False, False
            with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=headers,
                              timeout=60) as response:
                if response.status_code in (429, 503):
                    return None
                if response.status_code != 200:
                    self.failures.append(f"{key}: {response.status_code} {response.read()[:300]!r}"
                                         f"{self.mismatch(url, response)}")
                    return None
                hang_up = self.rng.randint(1, 12) if lost else None
                for number, line in enumerate(response.iter_lines()):
                    if number == hang_up:
                        self.hung_up += 1
                        return None
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[len("data: "):])
                        if "error" in event:
                            if event["error"].get("code") != "server_shutting_down":
                                self.failures.append(f"{key}: error event {event['error']}")
                            return None
                        for choice in event.get("choices", []):
                            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
                            finished = finished or choice.get("finish_reason") is not None
            return text if finished and done else None
        except httpx.TimeoutException:
            self.hung_up += 1
            return None
        except (httpx.TransportError, json.JSONDecodeError):  # the server was killed mid-answer: ask again
            return None


    def mismatch(self, url: str, response) -> str:
        """For a 409 (the session's record of the conversation differs from this client's), both
        sides' ends, so that a failure shows which answer differs and how."""
        if response.status_code != 409:
            return ""
        try:
            transcript = httpx.get(f"{url}/v1/sessions/{self.session}", timeout=30).json()["transcript"]
        except Exception as error:  # the server may be going down: say so, keep the failure
            transcript = f"(not read: {type(error).__name__})"
        return (f" | the client's last two answers {ascii(self.answers[-2:])}"
                f" | the session's transcript ends {ascii(transcript[-400:])}")


def clients() -> list[Client]:
    rng = random.Random(SEED + 1)
    return [Client("greedy-chat", "chat", rng), Client("sampled-chat", "sampled", rng),
            Client("completions", "completion", rng)]


def converse(url, the_clients: list[Client], stop: threading.Event) -> None:
    threads = [threading.Thread(target=c.run, args=(url, stop)) for c in the_clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def sessions_said(url: str, the_clients: list[Client]) -> dict:
    said = {}
    for client in the_clients:
        state = httpx.get(f"{url}/v1/sessions/{client.session}", timeout=30).json()
        said[client.session] = {k: state[k] for k in ("transcript", "transcript_tokens", "tick")}
    return said


class Serve:
    """`run.py serve` on a session directory, started again after each kill; its stderr to a
    file per start (read for its URL, and for tracebacks)."""

    def __init__(self, directory: Path, logs: Path):
        self.directory, self.logs, self.starts = directory, logs, 0
        self.process: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self) -> None:
        self.starts += 1
        log = self.logs / f"serve-{self.starts}.log"
        command = [sys.executable, str(ROOT / "run.py"), "serve", "-m", MODEL, "--port", "0", "--session-dir",
                   str(self.directory), *SERVE_ARGS]
        # each checkpoint file waits 20 ms on disk before its rename (mirror.storage.WRITE_DELAY_S):
        # long enough that a kill aimed at a checkpoint lands in the middle of one
        env = {**os.environ, "POSITRONIC_TEST_WRITE_DELAY_S": "0.02"}
        with open(log, "w") as err:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)
        self.log = log

    def wait_url(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := re.search(r"running on (http://\S+)", self.log.read_text()):
                self.url = found.group(1)
                return
            assert self.process.poll() is None, f"serve exited {self.process.returncode}: {self.log.read_text()}"
            time.sleep(0.05)
        raise AssertionError(f"serve did not start: {self.log.read_text()}")

    def kill(self, number: int) -> int:
        self.url = None
        self.process.send_signal(number)
        code = self.process.wait(timeout=90)
        text = self.log.read_text()
        assert "Traceback" not in text, text
        return code


def temporaries_in(directory: Path) -> set[Path]:
    """The checkpoint files being written (`*.tmp`) in the session directories. A session the
    server lets go before its first checkpoint takes its empty directory with it (sessions.Claim),
    which can happen while the directory is being listed: then it is listed again."""
    while True:
        try:
            return set(directory.glob("*/*.tmp"))
        except FileNotFoundError:
            continue


def test_serve_killed_at_random_moments_loses_no_turn_of_any_session(tiny, tmp_path, live_server, server_settings):
    reference = clients()
    with live_server(tiny, server_settings(tmp_path / "reference"), CONFIG) as server:
        converse(lambda: server.url, reference, threading.Event())
        expected = sessions_said(server.url, reference)
    assert not any(c.failures for c in reference), [c.failures for c in reference]

    serve = Serve(tmp_path / "sessions", tmp_path)
    soaked, stop, rng, kills = clients(), threading.Event(), random.Random(SEED), []
    serve.start()
    serve.wait_url()
    talking = threading.Thread(target=converse, args=(lambda: serve.url, soaked, stop))
    talking.start()
    try:
        while len(kills) < KILLS and talking.is_alive():
            stale = temporaries_in(serve.directory)  # left by earlier kills, until a session's next save
            moment = rng.random()
            number = rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM])
            when = "start-up" if moment < 0.2 else "checkpoint" if moment < 0.4 else "traffic"
            if len(kills) < len(PLAN):  # the suite's few kills cover every kind
                when, number = PLAN[len(kills)]
            if when == "start-up":  # the model loading, uvicorn starting
                time.sleep(rng.uniform(0.0, 4.0))
            elif when == "checkpoint":  # while a checkpoint file is being written: killed in the middle
                serve.wait_url()
                number = signal.SIGKILL
                deadline = time.monotonic() + 10
                while not temporaries_in(serve.directory) - stale and time.monotonic() < deadline:
                    pass
            else:
                serve.wait_url()
                time.sleep(rng.uniform(0.05, 1.5))
            code = serve.kill(number)
            temporaries = len(temporaries_in(serve.directory) - stale)  # a checkpoint this kill cut mid-write
            kills.append((when, signal.Signals(number).name, code, temporaries))
            serve.start()
        serve.wait_url()
        talking.join(timeout=300)
        assert not talking.is_alive(), "the clients did not finish"
        said = sessions_said(serve.url, soaked)
    finally:
        stop.set()
        talking.join(timeout=60)
        if serve.process.poll() is None:
            final = serve.kill(signal.SIGTERM)
    assert final == -signal.SIGTERM  # a clean stop: every session checkpointed
    assert not any(c.failures for c in soaked), [c.failures for c in soaked]
    for client, ref in zip(soaked, reference):
        assert client.answers == ref.answers, client.session
    assert said == expected
    codes = {code for _, _, code, _ in kills}
    assert sum(1 for *_, cut in kills if cut) >= 1, kills  # the checkpoint kill did cut a write
    assert codes <= {-signal.SIGKILL, -signal.SIGTERM}, kills  # a SIGTERM never loses a session (exit 1)
    kinds = sorted({(w, n, c) for w, n, c, _ in kills})
    print(f"server soak: {len(kills)} kills (" + ", ".join(f"{w} {n}->{c}: {sum(1 for k in kills if k[:3] == (w, n, c))}"
                                                       for w, n, c in kinds) + "), "
          f"{serve.starts} starts, {sum(c.attempts for c in soaked)} requests for "
          f"{sum(len(c.answers) for c in soaked)} answers ({sum(c.hung_up for c in soaked)} dropped by the "
          f"clients), kills that cut a checkpoint mid-write: "
          f"{sum(1 for *_, t in kills if t)}; every answer and transcript equal to the uninterrupted run's")
