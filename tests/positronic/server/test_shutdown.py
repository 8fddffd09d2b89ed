"""A graceful stop (SIGTERM, uvicorn's should_exit) with requests in flight, as `serve` runs it
(app.GracefulServer, which tells the app when the shutdown begins):

- a stream is cut at its next token: the client gets every token generated, then a final error
  event (503-type `server_error`, code `server_shutting_down`) and `data: [DONE]`; the session
  is checkpointed with exactly those tokens;
- a whole (non-streamed) reply in flight goes on to its end within the graceful period and is
  answered; if uvicorn has to cancel it, the client gets a 503 in OpenAI's error shape and the
  session is not checkpointed (its client never got the reply), which close() reports as lost;
- no CancelledError tracebacks in the log.
"""

import json
import logging
import re
import signal
import threading
import time

import httpx
import pytest
import uvicorn

from positronic.brain import session as sessions
from positronic.server.app import GracefulServer, exit_status

MODEL = "random:tiny"


@pytest.fixture
def graceful(live_server):
    """graceful(lm, settings, graceful_s) -> a LiveServer run by app.GracefulServer (as `serve`
    runs it), with uvicorn's timeout_graceful_shutdown of graceful_s."""

    def make(lm, settings, graceful_s: float):
        server = live_server(lm, settings)
        server.uvicorn = GracefulServer(uvicorn.Config(server.app, log_level="warning", access_log=False,
                                                       timeout_graceful_shutdown=graceful_s))
        server.thread = threading.Thread(target=server.uvicorn.run, kwargs={"sockets": [server.socket]}, daemon=True)
        return server

    return make


def saved(lm, settings, session_id: str) -> tuple[int, str]:
    """A session's checkpoint: its tick, and the text of the tokens it generated as a client
    reads them (decoded in context after the prompt, as the server sends a reply)."""
    mirror, meta = sessions.load(settings.session_dir / session_id)
    entries = mirror.ledger.entries
    prompt = [e.token_id for e in entries if e.source == "prompt"]
    generated = [e.token_id for e in entries if e.source == "generated"]
    anchor = lm.decode(prompt[-1:])
    return meta["tick"], lm.decode(prompt[-1:] + generated)[len(anchor):]


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def generating(server, session_id: str) -> bool:
    response = server.get(f"/v1/sessions/{session_id}")
    return response.status_code == 200 and response.json()["tick"] > 0


class Clients:
    """A whole request and a stream, each in a thread, and what each client saw."""

    def __init__(self, server, whole_tokens: int):
        self.server, self.whole, self.events = server, None, []
        self.streaming = threading.Event()
        body = {"model": MODEL, "prompt": "go", "ignore_eos": True}
        self.threads = [
            threading.Thread(target=self._whole, args=({**body, "user": "whole", "max_tokens": whole_tokens},)),
            threading.Thread(target=self._stream, args=({**body, "user": "stream", "max_tokens": 4000,
                                                         "stream": True},))]

    def _whole(self, body):
        self.whole = httpx.post(self.server.url + "/v1/completions", json=body, timeout=60)

    def _stream(self, body):
        with httpx.stream("POST", self.server.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    self.events.append(line)
                    if len(self.events) >= 3:
                        self.streaming.set()

    def start(self) -> None:
        for thread in self.threads:
            thread.start()
        assert self.streaming.wait(20), "the stream never started"
        wait_for(lambda: generating(self.server, "whole"), "the whole reply to start")

    def join(self) -> None:
        for thread in self.threads:
            thread.join(60)
            assert not thread.is_alive(), "a client hung"

    def stream_view(self) -> tuple[str, int]:
        """The streamed text and the token count its error event gives; fails unless the stream
        ends with the shutdown's error event and [DONE]."""
        assert self.events[-1] == "data: [DONE]", self.events[-3:]
        error = json.loads(self.events[-2].removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("server_error", "server_shutting_down")
        chunks = [json.loads(e.removeprefix("data: ")) for e in self.events[:-2]]
        assert all("error" not in c and c["choices"][0]["finish_reason"] is None for c in chunks)
        tokens = int(re.search(r"cut after (\d+) tokens", error["message"]).group(1))
        return "".join(c["choices"][0]["text"] for c in chunks), tokens


def no_tracebacks(caplog) -> None:
    troubles = [r for r in caplog.records if r.exc_info or "CancelledError" in r.getMessage()
                or "Exception in ASGI" in r.getMessage()]
    assert not troubles, [r.getMessage() for r in troubles]


def test_a_stop_cuts_a_stream_cleanly_and_answers_a_whole_reply(tiny, tmp_path, server_settings, graceful, caplog):
    settings = server_settings(tmp_path)
    with caplog.at_level(logging.INFO):
        with graceful(tiny, settings, graceful_s=20) as server:
            clients = Clients(server, whole_tokens=300)
            clients.start()
        clients.join()
    # the whole reply: finished and answered
    assert clients.whole.status_code == 200, clients.whole.text
    answer = clients.whole.json()
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 300
    assert saved(tiny, settings, "whole") == (300, answer["choices"][0]["text"])
    # the stream: every token generated was sent, then the error event and [DONE]; the session keeps just those
    text, tokens = clients.stream_view()
    assert 0 < tokens < 4000
    assert saved(tiny, settings, "stream") == (tokens, text)
    assert server.server.lost == {} and exit_status(server.server) == 0
    no_tracebacks(caplog)


def test_a_whole_reply_the_stop_cannot_wait_for_gets_503_and_is_not_saved(tiny, tmp_path, server_settings,
                                                                          graceful, caplog, monkeypatch):
    from positronic.server.turn import Turn

    original = Turn._next_token

    def slow(turn, tick):  # 4,000 tokens take >= 8 s, whatever the machine: the 1 s graceful period cannot wait
        time.sleep(0.002)
        return original(turn, tick)

    monkeypatch.setattr(Turn, "_next_token", slow)
    settings = server_settings(tmp_path)
    with caplog.at_level(logging.INFO):
        with graceful(tiny, settings, graceful_s=1.0) as server:
            clients = Clients(server, whole_tokens=4000)
            clients.start()
        clients.join()
    assert clients.whole.status_code == 503, clients.whole.text
    error = clients.whole.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("server_error", "server_shutting_down")
    assert not (settings.session_dir / "whole").exists(), "a reply its client never got was checkpointed"
    assert set(server.server.lost) == {"whole"} and exit_status(server.server) == 1
    text, tokens = clients.stream_view()  # the stream was cut cleanly before uvicorn's deadline
    assert saved(tiny, settings, "stream") == (tokens, text)
    no_tracebacks(caplog)


def test_a_request_after_the_stop_began_gets_503(tiny, tmp_path, server_settings, graceful):
    with graceful(tiny, server_settings(tmp_path), graceful_s=5) as server:
        server.server.begin_shutdown()
        for stream in (False, True):
            response = server.post("/v1/completions", {"model": MODEL, "prompt": "late", "max_tokens": 2,
                                                       "stream": stream})
            assert response.status_code == 503
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "server_shutting_down")


def test_a_second_ctrl_c_at_once_still_checkpoints_and_exits_without_a_traceback(tmp_path, serve_process):
    """Two SIGINTs 0.05 s apart (uvicorn's force_exit): uvicorn alone skipped the app's shutdown
    and re-raised both signals, and the sessions were saved only as asyncio tore the loop down,
    with a KeyboardInterrupt/CancelledError traceback."""
    # --checkpoint-when-idle: the session is written only by the shutdown
    process, url = serve_process("--session-dir", str(tmp_path), "-t", "1", "--checkpoint-when-idle")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "twice"}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        process.send_signal(signal.SIGINT)
        time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        rest = process.communicate(timeout=60)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, rest
    assert "Traceback" not in rest and "CancelledError" not in rest, rest
    assert "a second Ctrl-C" in rest
    assert sessions.load(tmp_path / "twice")[1]["tick"] > 0
