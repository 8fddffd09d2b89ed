"""The HTTP server (positronic/server/app.py): a real uvicorn on a free local port, driven with
the official openai client and with raw HTTP (httpx) for the wire format and the errors.

Servers run greedy (temperature 0) on the tiny random model, so a reply can be compared token
for token with a brain run directly, or with the same conversation in another session. The
server itself (LiveServer) and the request helpers are fixtures in tests/positronic/conftest.py;
the session pool, the metrics, the chat text and the streamed answers have their own modules
(test_sessions.py, test_metrics.py, test_text.py, test_streaming.py), `positronic serve` is
tested in tests/positronic/cli/test_serve.py.
"""

import json
import logging
import re
import socket
import threading
import time

import httpx
import pytest

from positronic.brain.loop import Brain, BrainConfig

MODEL = "random:tiny"


def extension(response) -> dict:
    return response.model_extra["positronic"]


def greedy(lm, prompt_ids, ticks, config: BrainConfig) -> tuple[list[int], Brain]:
    """The tokens a brain run directly generates after `prompt_ids`."""
    brain = Brain.start(lm, prompt_ids, config)
    return [brain.step().token_id for _ in range(ticks)], brain


# -- generation ---------------------------------------------------------------------------------

def test_a_completion_is_what_the_brain_generates(live, tiny, server_config):
    client = live.client()
    response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12)
    ids, _ = greedy(tiny, [tiny.bos_id] + tiny.encode("Hello"), 12, server_config)
    assert tiny.eos_id not in ids, "the comparison assumes a reply that runs to max_tokens"
    choice = response.choices[0]
    assert choice.text == tiny.decode(ids)
    assert choice.finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (6, 12)  # BOS + 5 bytes
    assert response.object == "text_completion" and response.model == MODEL
    assert extension(response)["session"] is None and extension(response)["tick"] == 12


def test_a_chat_reply_reads_the_conversation_in_the_chat_form(live, tiny, server_config, chat):
    response = chat(live.client(), None, "Hi there", max_tokens=10)
    prompt = [tiny.bos_id] + tiny.encode("\nUser: Hi there\nAssistant:")  # the plain form: no template
    ids, _ = greedy(tiny, prompt, 10, server_config)
    assert response.choices[0].message.content == tiny.decode(ids)
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(prompt)
    assert response.object == "chat.completion"


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


def test_sampling_settings_apply_to_the_request_only(live, chat):
    client = live.client()
    greedy_text = chat(client, "sampler", "Roll the dice", max_tokens=12).choices[0].message.content
    hot = chat(client, None, "Roll the dice", max_tokens=12, temperature=2.0, top_p=1.0)
    assert hot.choices[0].message.content != greedy_text
    assert live.server.pool.loaded["sampler"].brain.config.temperature == 0.0  # the session keeps its own


# -- sessions -----------------------------------------------------------------------------------

def test_two_sessions_interleaved_do_not_mix(live, conversation):
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


def test_a_long_chat_stays_within_budget_and_reads_only_each_new_turn(live, tiny, server_config, chat):
    client = live.client()
    history, lengths = [], []
    for turn in range(8):
        text = f"turn {turn} of a long chat"
        reply = chat(client, "long", text, max_tokens=16, history=history)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply.choices[0].message.content}]
        state = extension(reply)
        assert state["live_length"] <= server_config.budget
        lengths.append(state["ledger_tokens"])
        if turn:  # the previous reply's closing (none in the plain form) and this turn: never the history again
            assert reply.usage.prompt_tokens == len(tiny.encode(f"\nUser: {text}\nAssistant:"))
    assert lengths[-1] > 2 * server_config.budget, "the chat went far past the budget"
    assert lengths == sorted(lengths)
    session = live.get("/v1/sessions/long").json()
    assert session["culled"] > 0 and session["live_length"] <= server_config.budget
    assert "turn 0 of a long chat" in session["transcript"] and "turn 0 of a long chat" not in session["live_text"]
    assert "turn 7 of a long chat" in session["live_text"]


def test_a_session_counts_the_tokens_its_requests_said(live, server_config, chat):
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
    assert session["transcript_tokens"] == said > server_config.budget
    assert session["culled"] > 0 and session["ledger_tokens"] >= said


# -- limits and cancellation --------------------------------------------------------------------

def ticks(server) -> float:
    return server.metric("positronic_ticks_total")


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
def test_a_client_that_disconnects_cancels_its_generation(tiny, tmp_path, stream, live_server, server_settings):
    with live_server(tiny, server_settings(tmp_path)) as server:
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


def test_too_many_requests_and_busy_sessions_are_refused_with_429(tiny, tmp_path, live_server, server_settings):
    with live_server(tiny, server_settings(tmp_path, max_sessions=1, max_pending=1)) as server:
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
    ("/v1/completions", {**GOOD, "n": 0}, {}, 400, "n", "invalid_value"),
    ("/v1/completions", {**GOOD, "suffix": "and so on"}, {}, 400, "suffix", "unsupported"),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, {}, 400, "stop", "invalid_value"),
    # past the model's 512 positions (a prompt past the budget alone is pruned, not refused)
    ("/v1/completions", {**GOOD, "prompt": "x" * 600}, {}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {**GOOD, "prompt": [1, 99999]}, {}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**GOOD, "prompt": ["a", "b"], "user": "s1"}, {}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**GOOD, "user": "a/b"}, {}, 400, "user", "invalid_session_id"),
    ("/v1/completions", {**GOOD, "user": "x" * 65}, {}, 400, "user", "invalid_session_id"),
    ("/v1/completions", {**GOOD, "user": ""}, {}, 400, "user", "invalid_session_id"),
    ("/v1/completions", GOOD, {"X-Session-Id": "../etc"}, 400, None, "invalid_session_id"),
    ("/v1/completions", {**GOOD, "user": "a"}, {"X-Session-Id": "b"}, 400, "user", "invalid_session_id"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, {}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "function", "content": "x"}]}, {}, 400, "messages.0.role",
     "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {}, 400,
     "messages.0.content", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "y" * 600}]}, {}, 400, "messages",
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


def test_a_body_over_the_limit_is_refused_with_413(tiny, tmp_path, live_server, server_settings):
    with live_server(tiny, server_settings(tmp_path, max_body_bytes=2048)) as server:
        big = {**GOOD, "prompt": "x" * 4000}
        response = server.post("/v1/completions", big)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        assert "limit of 2048 bytes (serve --max-body)" in response.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit is counted as the body arrives
            yield json.dumps(big).encode()

        response = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)
        assert response.status_code == 413
        assert server.post("/v1/completions", GOOD).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**GOOD, "prompt": "x" * 200_000}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "system", "content": "s" * 100_000},
                                                   {"role": "user", "content": "u" * 100_000}]}),
])
def test_a_prompt_too_long_by_its_length_alone_is_refused_before_it_is_encoded(live, path, body):
    """No token covers more characters than the vocabulary's longest entry (6 here): 200,000
    characters are at least 33,334 tokens, past the 512 positions without encoding a character
    (three 1 MB prompts were encoded first, stalling the server for seconds)."""
    error = live.post(path, body).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert re.search(r"is at least 333\d\d tokens, more than the 512 positions", error["message"]), error["message"]


def test_a_running_sessions_turn_too_long_by_its_length_alone_is_refused_before_it_is_encoded(live):
    for path, first, long in [
            ("/v1/completions", {**GOOD, "user": "long-prompt"}, {**GOOD, "user": "long-prompt", "prompt": "p" * 9000}),
            ("/v1/chat/completions", {**CHAT, "user": "long-turn"},
             {**CHAT, "user": "long-turn", "messages": [{"role": "user", "content": "t" * 9000}]})]:
        assert live.post(path, first).status_code == 200
        tick = live.get(f"/v1/sessions/{first['user']}").json()["tick"]
        error = live.post(path, long).json()["error"]
        assert error["code"] == "context_length_exceeded" and "is at least 1500 tokens" in error["message"], error
        assert live.get(f"/v1/sessions/{first['user']}").json()["tick"] == tick  # the session as it was


def test_a_client_that_disconnects_mid_body_is_one_line_not_a_500(live, caplog):
    """It was two ERROR tracebacks (ClientDisconnect, through the app's 500 handler and uvicorn's)
    and a 500 in the metrics; now one INFO line and a 499, and the server goes on."""
    def count(status: str) -> float:
        try:
            return live.metric("positronic_requests_total", endpoint="/v1/completions", status=status)
        except KeyError:
            return 0.0

    errors, gone = count("500"), count("499")
    body = json.dumps({**GOOD, "prompt": "half " * 200}).encode()
    with caplog.at_level(logging.INFO, logger="positronic"):
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
            time.sleep(0.2)  # the server is reading the body when the client goes
        deadline = time.monotonic() + 20
        while count("499") == gone:
            assert time.monotonic() < deadline, "the request was never counted"
            time.sleep(0.02)
    assert count("500") == errors
    lines = [r for r in caplog.records if r.name.startswith("positronic")]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and not lines[0].exc_info
    assert "disconnected before sending its whole request body" in lines[0].getMessage()
    assert live.post("/v1/completions", GOOD).status_code == 200


# -- metrics, health, models --------------------------------------------------------------------

def test_health_and_models(live, server_config):
    health = live.get("/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["budget"] == server_config.budget
    assert health["sessions"]["max"] == 16 and health["requests_in_flight"] == 0
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert live.client().models.retrieve(MODEL).id == MODEL
