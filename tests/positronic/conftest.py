"""Fixtures shared by the test modules of positronic/ (the folder's own modules)."""

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from positronic.brain.loop import BrainConfig
from positronic.server.app import ServerSettings, create_app
from positronic.state import ContextView


def _crafted_view(token_ids, predicted, brightness=None) -> ContextView:
    n = len(token_ids)
    return ContextView(token_ids=torch.tensor(token_ids), ledger_ids=torch.arange(n), positions=torch.arange(n),
                       brightness=torch.tensor(brightness if brightness is not None else [255.0] * n),
                       predicted=torch.tensor(predicted))


@pytest.fixture(scope="session")
def crafted_view():
    """crafted_view(token_ids, predicted, brightness=None) -> a ContextView built by hand (what a
    policy or repairer sees; no StateManager behind it), ledger ids and positions 0..n-1."""
    return _crafted_view


# -- the HTTP server (positronic/server*.py) ------------------------------------------------------

SERVER_CONFIG = BrainConfig(budget=96, window=16, sinks=4, temperature=0.0, seed=0)


def _metric(text: str, name: str, **labels) -> float:
    wanted = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in text.splitlines():
        if line.startswith(name + wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{wanted} not in the exposition")


class LiveServer:
    """create_app served by uvicorn in a thread, on a port of its own; stopping it is a
    graceful shutdown (the app's lifespan checkpoints its sessions). `app_options` go to
    create_app (api_key, cors_origins). `start_s`: how long its start may take (a server with
    compiled rounds makes their graphs first)."""

    def __init__(self, lm, settings: ServerSettings, config: BrainConfig = SERVER_CONFIG, *, start_s: float = 20,
                 **app_options):
        self.start_s = start_s
        self.app = create_app(lm, config, settings, **app_options)
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                     timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def server(self):
        """The app's BrainServer (its pool, its settings)."""
        return self.app.state.server

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + self.start_s
        while not self.uvicorn.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(20)
        assert not self.thread.is_alive(), "the server did not stop"
        self.socket.close()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, json=body, **{"timeout": 30, **kwargs})

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def metric(self, name: str, **labels) -> float:
        """One sample of GET /metrics now."""
        return _metric(self.get("/metrics").text, name, **labels)


def _server_settings(tmp_path, **changes) -> ServerSettings:
    return ServerSettings(session_dir=tmp_path / "sessions", **changes)


def _chat(client, session, text, max_tokens=8, history=(), **kwargs):
    messages = list(history) + [{"role": "user", "content": text}]
    return client.chat.completions.create(model="random:tiny", messages=messages, max_tokens=max_tokens,
                                          **({"user": session} if session else {}), **kwargs)


def _conversation(client, session, texts, max_tokens=8):
    history, replies = [], []
    for text in texts:
        reply = _chat(client, session, text, max_tokens=max_tokens, history=history)
        content = reply.choices[0].message.content
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": content}]
        replies.append(content)
    return replies


@pytest.fixture(scope="session")
def server_config() -> BrainConfig:
    """The brain settings the test servers run with: greedy (temperature 0), budget 96."""
    return SERVER_CONFIG


@pytest.fixture(scope="session")
def live_server():
    """live_server(lm, settings, config=server_config, **app_options) -> a LiveServer context
    manager: the app served by uvicorn on a free local port (client(), post(), get(), metric(),
    .server); app_options go to create_app (api_key, cors_origins)."""
    return LiveServer


@pytest.fixture(scope="session")
def server_settings():
    """server_settings(tmp_path, **changes) -> ServerSettings with sessions under tmp_path/sessions."""
    return _server_settings


@pytest.fixture(scope="module")
def live(tiny, tmp_path_factory):
    """One server on the tiny model for a whole test module (max_tokens 2000)."""
    with LiveServer(tiny, _server_settings(tmp_path_factory.mktemp("server"), max_tokens=2000)) as server:
        yield server


@pytest.fixture(scope="session")
def chat():
    """chat(client, session, text, max_tokens=8, history=(), **kwargs): one chat request of
    `session` (None: a throwaway brain) with `history` before `text`."""
    return _chat


@pytest.fixture(scope="session")
def conversation():
    """conversation(client, session, texts, max_tokens=8) -> the replies of a session that says
    each of `texts` in turn (sending its history, as chat clients do)."""
    return _conversation


@pytest.fixture(scope="session")
def metric():
    """metric(text, name, **labels) -> the value of one sample in a Prometheus exposition."""
    return _metric


def _serve_process(*args: str) -> tuple[subprocess.Popen, str]:
    """`run.py serve -m random:tiny --port 0 ARGS` as a process of its own, and the URL uvicorn
    says it runs on (its stderr is read up to that line; the caller reads the rest)."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, str(root / "run.py"), "serve", "-m", "random:tiny", "--port", "0", *args]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=root)
    for line in process.stderr:  # uvicorn names the port it got
        if found := re.search(r"running on (http://\S+)", line):
            return process, found.group(1)
    process.kill()
    raise AssertionError("the server never said where it runs")


@pytest.fixture(scope="session")
def serve_process():
    """serve_process(*args) -> (process, url): a real `serve` process on a free port."""
    return _serve_process
