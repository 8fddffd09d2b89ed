"""The HTTP server (positronic/server.py): a real uvicorn on a free local port, driven with
the official openai client and with raw HTTP (httpx) for the wire format and the errors.

Servers run greedy (temperature 0) on the tiny random model, so a reply can be compared token
for token with a brain run directly, or with the same conversation in another session.
"""

import dataclasses
import json
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
import uvicorn

from positronic import session as sessions
from positronic.loop import Brain, BrainConfig
from positronic.server import ServerSettings, create_app
from positronic.server_text import ChatFormat, Reply, StopScanner


MODEL = "random:tiny"
CONFIG = BrainConfig(budget=96, window=16, sinks=4, temperature=0.0, seed=0)
ROOT = Path(__file__).resolve().parents[2]


class LiveServer:
    """create_app served by uvicorn in a thread, on a port of its own; stopping it is a
    graceful shutdown (the app's lifespan checkpoints its sessions)."""

    def __init__(self, lm, settings: ServerSettings, config: BrainConfig = CONFIG):
        self.app = create_app(lm, config, settings)
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
        deadline = time.monotonic() + 20
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


def settings(tmp_path, **changes) -> ServerSettings:
    return ServerSettings(session_dir=tmp_path / "sessions", **changes)


@pytest.fixture(scope="module")
def live(tiny, tmp_path_factory):
    with LiveServer(tiny, settings(tmp_path_factory.mktemp("server"), max_tokens=2000)) as server:
        yield server


def chat(client, session, text, max_tokens=8, history=(), **kwargs):
    """One chat request of `session` (None: a throwaway brain) with `history` before `text`."""
    messages = list(history) + [{"role": "user", "content": text}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          **({"user": session} if session else {}), **kwargs)


def conversation(client, session, texts, max_tokens=8):
    """The replies of a session that says each of `texts` in turn (sending its history, as
    chat clients do)."""
    history, replies = [], []
    for text in texts:
        reply = chat(client, session, text, max_tokens=max_tokens, history=history)
        content = reply.choices[0].message.content
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": content}]
        replies.append(content)
    return replies


def extension(response) -> dict:
    return response.model_extra["positronic"]


def greedy(lm, prompt_ids, ticks, config=CONFIG) -> tuple[list[int], Brain]:
    """The tokens a brain run directly generates after `prompt_ids`."""
    brain = Brain.start(lm, prompt_ids, config)
    return [brain.step().token_id for _ in range(ticks)], brain


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in a Prometheus exposition."""
    wanted = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in text.splitlines():
        if line.startswith(name + wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{wanted} not in the exposition")


# -- generation ---------------------------------------------------------------------------------

def test_a_completion_is_what_the_brain_generates(live, tiny):
    client = live.client()
    response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12)
    ids, _ = greedy(tiny, [tiny.bos_id] + tiny.encode("Hello"), 12)
    assert tiny.eos_id not in ids, "the comparison assumes a reply that runs to max_tokens"
    choice = response.choices[0]
    assert choice.text == tiny.decode(ids)
    assert choice.finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (6, 12)  # BOS + 5 bytes
    assert response.object == "text_completion" and response.model == MODEL
    assert extension(response)["session"] is None and extension(response)["tick"] == 12


def test_a_chat_reply_reads_the_conversation_in_the_chat_form(live, tiny):
    response = chat(live.client(), None, "Hi there", max_tokens=10)
    prompt = [tiny.bos_id] + tiny.encode("\nUser: Hi there\nAssistant:")  # the plain form: no template
    ids, _ = greedy(tiny, prompt, 10)
    assert response.choices[0].message.content == tiny.decode(ids)
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(prompt)
    assert response.object == "chat.completion"


def test_streaming_gives_the_same_text_in_openai_chunks(live):
    client = live.client()
    whole = chat(client, None, "Stream me", max_tokens=14).choices[0].message.content
    chunks = list(chat(client, None, "Stream me", max_tokens=14, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 14 and not chunks[-1].choices
    text = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt="abc", max_tokens=9,
                                                                         stream=True))
    assert text == client.completions.create(model=MODEL, prompt="abc", max_tokens=9).choices[0].text


def test_the_stream_is_server_sent_events_ending_with_done(live):
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "wire", "max_tokens": 5, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_ends_the_reply_before_it(live):
    client = live.client()
    full = client.completions.create(model=MODEL, prompt="stop here", max_tokens=20).choices[0].text
    stop = next(full[i:i + 2] for i in range(4, len(full) - 2) if full[i:i + 2].isprintable()
                and full.find(full[i:i + 2]) == i)
    cut = client.completions.create(model=MODEL, prompt="stop here", max_tokens=20, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="stop here", max_tokens=20, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]


def test_sampling_settings_apply_to_the_request_only(live):
    client = live.client()
    greedy_text = chat(client, "sampler", "Roll the dice", max_tokens=12).choices[0].message.content
    hot = chat(client, None, "Roll the dice", max_tokens=12, temperature=2.0, top_p=1.0)
    assert hot.choices[0].message.content != greedy_text
    assert live.server.pool.loaded["sampler"].brain.config.temperature == 0.0  # the session keeps its own


# -- sessions -----------------------------------------------------------------------------------

def test_two_sessions_interleaved_do_not_mix(live):
    """Alice and Bob talk at the same time (threads: their ticks interleave on the model
    thread); Alice's replies are those of Carol, who says the same alone, and each
    transcript holds its own words only."""
    client = live.client()
    said = {"alice": ["I am Alice", "Alice likes tea", "Alice again"], "bob": ["Bob here", "Bob hates rain", "Bob?"]}
    replies = {}
    threads = [threading.Thread(target=lambda who: replies.__setitem__(who, conversation(client, who, said[who])),
                                args=(who,)) for who in said]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert replies["alice"] == conversation(client, "carol", said["alice"])
    assert replies["bob"] == conversation(client, "dave", said["bob"])
    alice = live.get("/v1/sessions/alice").json()["transcript"]
    bob = live.get("/v1/sessions/bob").json()["transcript"]
    assert all(text in alice for text in said["alice"]) and not any(text in alice for text in said["bob"])
    assert all(text in bob for text in said["bob"]) and not any(text in bob for text in said["alice"])


def test_a_session_header_names_the_session_too(live):
    client = live.client()
    first = client.completions.create(model=MODEL, prompt="Header", max_tokens=4,
                                      extra_headers={"X-Session-Id": "by-header"})
    second = client.completions.create(model=MODEL, prompt=" more", max_tokens=4,
                                       extra_headers={"X-Session-Id": "by-header"})
    assert extension(second)["session"] == "by-header"
    assert extension(second)["tick"] == extension(first)["tick"] + 5 + 4  # " more" read, then 4 generated
    assert second.usage.prompt_tokens == 5
    transcript = live.get("/v1/sessions/by-header").json()["transcript"]
    said = "<s>Header" + first.choices[0].text + " more" + second.choices[0].text
    merged = re.compile("\ufffd+")  # the ledger decodes each byte of a broken character apart
    assert merged.sub("?", transcript) == merged.sub("?", said)


def test_a_long_chat_stays_within_budget_and_reads_only_each_new_turn(live, tiny):
    client = live.client()
    history, lengths = [], []
    for turn in range(8):
        text = f"turn {turn} of a long chat"
        reply = chat(client, "long", text, max_tokens=16, history=history)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply.choices[0].message.content}]
        state = extension(reply)
        assert state["live_length"] <= CONFIG.budget
        lengths.append(state["ledger_tokens"])
        if turn:  # the previous reply's closing (none in the plain form) and this turn: never the history again
            assert reply.usage.prompt_tokens == len(tiny.encode(f"\nUser: {text}\nAssistant:"))
    assert lengths[-1] > 2 * CONFIG.budget, "the chat went far past the budget"
    assert lengths == sorted(lengths)
    session = live.get("/v1/sessions/long").json()
    assert session["culled"] > 0 and session["live_length"] <= CONFIG.budget
    assert "turn 0 of a long chat" in session["transcript"] and "turn 0 of a long chat" not in session["live_text"]
    assert "turn 7 of a long chat" in session["live_text"]


def test_a_session_counts_the_tokens_its_requests_said(live):
    """transcript_tokens is the sum of the session's usage, past the budget (culled rows
    still count) and whichever endpoint or form said them (bench/serve_load.py checks it)."""
    client, said = live.client(), 0
    eos = {"extra_body": {"ignore_eos": True}}
    first = client.completions.create(model=MODEL, prompt="Counted", max_tokens=40, user="counted", **eos)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "and streamed"}],
                                            max_tokens=40, user="counted", stream=True,
                                            stream_options={"include_usage": True}, **eos)
    streamed = [chunk.usage for chunk in stream if chunk.usage is not None]
    third = chat(client, "counted", "once more", max_tokens=40, **eos)
    said = first.usage.total_tokens + streamed[-1].total_tokens + third.usage.total_tokens
    session = live.get("/v1/sessions/counted").json()
    assert session["transcript_tokens"] == said > CONFIG.budget
    assert session["culled"] > 0 and session["ledger_tokens"] >= said


def test_a_session_outlives_max_sessions_and_resumes_from_disk(tiny, live, tmp_path):
    """With room for two sessions, a third checkpoints the least recently used one to disk;
    it comes back on its next request, and after a restart, and says what it would have said
    had it stayed in memory (the module's server, with room to spare, is the reference)."""
    texts = ["first words", "second words", "third words", "fourth words"]
    reference = conversation(live.client(), "ref-resume", texts)
    small = settings(tmp_path, max_sessions=2)
    with LiveServer(tiny, small) as server:
        client = server.client()
        history = []

        def say(text):
            content = chat(client, "s1", text, history=history).choices[0].message.content
            history.extend([{"role": "user", "content": text}, {"role": "assistant", "content": content}])
            return content

        replies = [say(texts[0])]
        chat(client, "s2", "another")
        assert not (small.session_dir / "s1").exists()
        chat(client, "s3", "and another")  # no room: s1 goes to disk
        assert (small.session_dir / "s1" / "mirror.msgpack").exists()
        assert "s1" not in server.server.pool.loaded
        replies.append(say(texts[1]))  # back from disk (s2 goes)
        assert "s1" in server.server.pool.loaded and (small.session_dir / "s2").exists()
        replies.append(say(texts[2]))
        metrics = server.get("/metrics").text
        assert metric(metrics, "positronic_sessions_resumed_total") == 1
        assert metric(metrics, "positronic_sessions_saved_total") == 2
        live_sessions = server.get("/health").json()["sessions"]
        assert live_sessions["in_memory"] <= 2
    assert (small.session_dir / "s3").exists()  # the shutdown saved the sessions in memory
    with LiveServer(tiny, small) as server:  # a restart: s1 resumes from its shutdown checkpoint
        client = server.client()
        replies.append(say(texts[3]))
    assert replies == reference


def test_idle_sessions_are_checkpointed_and_freed(tiny, tmp_path):
    idle = settings(tmp_path, idle_save_s=0.2, sweep_every_s=0.05)
    with LiveServer(tiny, idle) as server:
        chat(server.client(), "sleepy", "zzz")
        deadline = time.monotonic() + 10
        while server.get("/health").json()["sessions"]["in_memory"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.get("/health").json()["sessions"]["in_memory"] == 0
        assert (idle.session_dir / "sleepy" / "mirror.msgpack").exists()
        assert server.get("/v1/sessions/sleepy").json()["transcript"].startswith("<s>\nUser: zzz")


# -- limits and cancellation --------------------------------------------------------------------

def ticks(server) -> float:
    return metric(server.get("/metrics").text, "positronic_ticks_total")


def wait_until_ticks_stop(server, timeout=10.0) -> float:
    """The tick count once it stops moving (generation cancelled), or fail."""
    deadline = time.monotonic() + timeout
    last = ticks(server)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = ticks(server)
        if now == last:
            return now
        last = now
    raise AssertionError("ticks went on: the generation was not cancelled")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_generation(tiny, tmp_path, stream):
    with LiveServer(tiny, settings(tmp_path)) as server:
        body = {"model": MODEL, "prompt": "go on and on", "max_tokens": 4000, "stream": stream, "user": "leaver",
                "ignore_eos": True}
        if stream:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                server.post("/v1/completions", body, timeout=0.5)
        stopped = wait_until_ticks_stop(server)
        assert 0 < stopped < 2000
        assert server.get("/v1/sessions/leaver").json()["tick"] == stopped
        after = server.post("/v1/completions", {**body, "max_tokens": 3, "stream": False})  # the session is free
        assert after.status_code == 200
        assert after.json()["positronic"]["tick"] == stopped + len(body["prompt"]) + 3  # its prompt read, 3 generated


def test_too_many_requests_and_busy_sessions_are_refused_with_429(tiny, tmp_path):
    with LiveServer(tiny, settings(tmp_path, max_sessions=1, max_pending=1)) as server:
        body = {"model": MODEL, "prompt": "hold", "max_tokens": 4000, "stream": True, "user": "holder", "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()  # kept: an iterator dropped closes the connection
            assert next(lines).startswith("data: ")
            refused = server.post("/v1/completions", {**body, "stream": False, "user": "other"})
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_requests"
            server.server.settings.max_pending = 2
            refused = server.post("/v1/completions", {**body, "stream": False, "user": "other"})
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_sessions"
        wait_until_ticks_stop(server)
        assert server.post("/v1/completions", {**body, "stream": False, "max_tokens": 2, "user": "other"}).status_code == 200


# -- errors -------------------------------------------------------------------------------------

GOOD = {"model": MODEL, "prompt": "ok", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "ok"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, headers, status, param, code", [
    ("/v1/completions", b"{not json", {}, 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", {}, 400, None, "invalid_json"),
    ("/v1/completions", {"prompt": "x"}, {}, 400, "model", "invalid_value"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, {}, 404, "model", "model_not_found"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, {}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {**GOOD, "max_tokens": -5}, {}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {**GOOD, "max_tokens": 2001}, {}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {**GOOD, "max_tokens": "3"}, {}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {**GOOD, "temperature": 3}, {}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {**GOOD, "top_p": 0}, {}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {**GOOD, "n": 2}, {}, 400, "n", "invalid_value"),
    ("/v1/completions", {**GOOD, "logprobs": 3}, {}, 400, "logprobs", "unsupported"),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, {}, 400, "stop", "invalid_value"),
    ("/v1/completions", {**GOOD, "prompt": "x" * 200}, {}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {**GOOD, "prompt": [1, 99999]}, {}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**GOOD, "prompt": ["a", "b"]}, {}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**GOOD, "user": "a/b"}, {}, 400, "user", "invalid_session_id"),
    ("/v1/completions", {**GOOD, "user": "x" * 65}, {}, 400, "user", "invalid_session_id"),
    ("/v1/completions", {**GOOD, "user": ""}, {}, 400, "user", "invalid_session_id"),
    ("/v1/completions", GOOD, {"X-Session-Id": "../etc"}, 400, None, "invalid_session_id"),
    ("/v1/completions", {**GOOD, "user": "a"}, {"X-Session-Id": "b"}, 400, "user", "invalid_session_id"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, {}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, {}, 400, "messages.0.role",
     "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {}, 400,
     "messages.0.content", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "y" * 200}]}, {}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, {}, 400, "max_completion_tokens", "invalid_value"),
])
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(live, path, body, headers, status, param, code):
    before = live.get("/health").json()["sessions"]["slots_in_use"]
    if isinstance(body, bytes):
        response = httpx.post(live.url + path, content=body, headers={"content-type": "application/json", **headers})
    else:
        response = live.post(path, body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error"
    assert live.post("/v1/completions", GOOD).status_code == 200  # still serving
    assert live.get("/health").json()["sessions"]["slots_in_use"] == before  # nothing left held


def test_a_running_session_refuses_a_turn_over_its_limit_and_a_request_without_a_new_turn(live):
    start = {**CHAT, "user": "strict"}
    assert live.post("/v1/chat/completions", start).status_code == 200
    over = live.post("/v1/chat/completions", {**start, "messages": [{"role": "user", "content": "z" * 90}]})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    ends_with_reply = live.post("/v1/chat/completions", {**start, "messages": [
        {"role": "user", "content": "ok"}, {"role": "assistant", "content": "fine"}]})
    assert ends_with_reply.status_code == 400 and ends_with_reply.json()["error"]["param"] == "messages"
    tick = live.get("/v1/sessions/strict").json()["tick"]
    assert live.post("/v1/chat/completions", start).status_code == 200  # the session goes on
    assert live.get("/v1/sessions/strict").json()["tick"] > tick


def test_http_errors_are_in_the_openai_shape_too(live):
    for response, status in [(live.get("/v1/nothing"), 404), (live.get("/v1/completions"), 405),
                             (live.get("/v1/sessions/nobody"), 404), (live.get("/v1/sessions/bad%20id"), 400),
                             (live.get("/v1/models/gpt-4"), 404)]:
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_body_over_the_limit_is_refused_with_413(tiny, tmp_path):
    with LiveServer(tiny, settings(tmp_path, max_body_bytes=2048)) as server:
        big = {**GOOD, "prompt": "x" * 4000}
        response = server.post("/v1/completions", big)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit is counted as the body arrives
            yield json.dumps(big).encode()

        response = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)
        assert response.status_code == 413
        assert server.post("/v1/completions", GOOD).status_code == 200


# -- metrics, health, models --------------------------------------------------------------------

def test_metrics_count_tokens_requests_and_maintenance(tiny, tmp_path):
    with LiveServer(tiny, settings(tmp_path)) as server:
        client = server.client()
        first = client.completions.create(model=MODEL, prompt="count me", max_tokens=100, user="m",
                                          extra_body={"ignore_eos": True})
        second = chat(client, None, "and me", max_tokens=7, extra_body={"ignore_eos": True})
        bad = server.post("/v1/completions", {**GOOD, "max_tokens": 0})
        assert bad.status_code == 400
        text = server.get("/metrics").text
    generated = first.usage.completion_tokens + second.usage.completion_tokens
    assert metric(text, "positronic_generated_tokens_total") == generated == 107
    assert metric(text, "positronic_prompt_tokens_total") == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert metric(text, "positronic_ticks_total") == generated  # prompts are prefilled, not ticked
    assert metric(text, "positronic_requests_total", endpoint="/v1/completions", status="200") == 1
    assert metric(text, "positronic_requests_total", endpoint="/v1/completions", status="400") == 1
    assert metric(text, "positronic_evictions_total") >= 9 + 100 - CONFIG.budget  # 109 tokens in a 96 budget
    assert metric(text, "positronic_repairs_total") == 0 and metric(text, "positronic_resurrections_total") == 0
    assert metric(text, "positronic_live_length", session="m") == extension(first)["live_length"] <= CONFIG.budget
    assert metric(text, "positronic_budget", session="m") == CONFIG.budget
    assert metric(text, "positronic_tokens_per_second") > 0
    count = metric(text, "positronic_request_duration_seconds_count", endpoint="/v1/chat/completions")
    assert count == 1 == metric(text, "positronic_request_duration_seconds_bucket", endpoint="/v1/chat/completions",
                                le="+Inf")
    buckets = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('positronic_request_duration_seconds_bucket{endpoint="/v1/completions"')]
    assert buckets == sorted(buckets) and buckets[-1] == 2
    assert "# TYPE positronic_request_duration_seconds histogram" in text
    for line in text.splitlines():  # every sample line is NAME{LABELS} NUMBER
        assert line.startswith("#") or re.fullmatch(r'[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [-+.\deInf]+',
                                                    line), line


def test_health_and_models(live):
    health = live.get("/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["budget"] == CONFIG.budget
    assert health["sessions"]["max"] == 16 and health["requests_in_flight"] == 0
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert live.client().models.retrieve(MODEL).id == MODEL


# -- the text helpers ---------------------------------------------------------------------------

def test_the_stop_scanner_never_sends_part_of_a_stop_string():
    scanner = StopScanner(["END", "xy"])
    assert scanner.push("abcE") == ("abc", False)
    assert scanner.push("N") == ("", False)
    assert scanner.push("Dafter") == ("", True)
    scanner = StopScanner(["END"])
    assert scanner.push("abE") == ("ab", False) and scanner.push("X") == ("EX", False)
    assert scanner.push("E") == ("", False) and scanner.flush() == "E"


def test_a_reply_holds_back_a_character_cut_in_half(tiny):
    euro = tiny.encode("€")  # three byte tokens
    reply = Reply(tiny, tiny.bos_id, max_tokens=10)
    assert [reply.add(t) for t in euro] == ["", "", "€"]
    assert reply.add(tiny.eos_id) == "" and reply.finish_reason == "stop" and reply.tokens == 4


@pytest.mark.slow
def test_the_chat_template_frames_turns_as_a_running_session_reads_them(smol):
    """SmolLM2's ChatML: a fresh conversation is the template's rendering, with the user's
    text literal; a session that gets the same turns one request at a time reads the same tokens."""
    chat_format = ChatFormat(smol)
    first = [{"role": "user", "content": "Say <|im_end|> now"}]
    ids = chat_format.conversation(first)
    rendered = smol.tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    assert smol.decode(ids) == rendered and ids[0] == smol.bos_id
    assert ids.count(smol.eos_id) == rendered.count("<|im_end|>") - 1  # the typed one is text
    reply = smol.encode("Sure")
    history = first + [{"role": "assistant", "content": "Sure"}, {"role": "user", "content": "Again"}]
    running = ids + reply + chat_format.reply_end(reply[-1]) + chat_format.user_turn("Again", 2000)
    assert running == chat_format.conversation(history)
    assert chat_format.reply_end(smol.eos_id) == smol.encode("\n")


# -- the command line ---------------------------------------------------------------------------

def test_serve_refuses_bad_flags_before_loading_a_model(tmp_path, capsys, run_cli):
    assert run_cli("serve", "-m", "no-such-model-anywhere", "--kv-eviction", "1", "--policy", "h2o") == 2
    assert "set the same thing" in capsys.readouterr().err
    assert run_cli("serve", "-m", "no-such-model-anywhere", "--budget", "20") == 2
    assert "budget 20" in capsys.readouterr().err
    assert run_cli("serve", "-m", MODEL, "--max-tokens", "10", "--default-max-tokens", "20",
                   "--session-dir", str(tmp_path)) == 2


def test_positronic_serve_serves_and_saves_its_sessions_on_sigterm(tmp_path):
    command = [sys.executable, str(ROOT / "run.py"), "serve", "-m", MODEL, "--port", "0", "--budget", "64",
               "--kv-sink-tokens", "2", "--session-dir", str(tmp_path), "-t", "1"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        url = None
        for line in process.stderr:  # uvicorn names the port it got
            if found := re.search(r"running on (http://\S+)", line):
                url = found.group(1)
                break
        assert url, "the server never said where it runs"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert chat(client, "cli", "hello").choices[0].finish_reason == "length"
        assert httpx.get(url + "/health").json()["budget"] == 64
        process.terminate()
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert (tmp_path / "cli" / "mirror.msgpack").exists()
    assert sessions.load(tmp_path / "cli")[1]["config"]["sinks"] == 2  # the llama.cpp alias reached the brain
