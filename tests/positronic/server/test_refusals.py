"""Requests the server must refuse with a 400 in OpenAI's error shape (never a 500): text
that is not valid Unicode, bodies nested too deeply, chat messages without content, sampling
values outside what the API allows; and sampling values at the edges of what it allows,
which must still give a well-formed stream.

Bodies are sent as raw bytes where JSON can say what Python's json.dumps would not write
(a lone surrogate escape, a number that overflows to inf, NaN).
"""

import json

import httpx
import pytest

MODEL = "random:tiny"
GOOD = {"model": MODEL, "prompt": "ok", "max_tokens": 2}


def post_raw(live, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(live.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)


def error_of(response: httpx.Response, status: int = 400) -> dict:
    """The OpenAI-shaped error of `response`, checked."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    return error


def still_serving(live) -> None:
    assert live.post("/v1/completions", GOOD).status_code == 200
    assert live.get("/health").json()["sessions"]["slots_in_use"] == 0


# -- text that is not Unicode, bodies too deep ---------------------------------------------------

@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions",
     b'{"model": "random:tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages.0.content"),
    ("/v1/chat/completions",
     b'{"model": "random:tiny", "max_tokens": 2, "user": "sur", "messages": [{"role": "user", "content": "ok"}, '
     b'{"role": "assistant", "content": "fine"}, {"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages.2.content.0.text"),
    ("/v1/completions", b'{"model": "random:tiny", "max_tokens": 2, "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", b'{"model": "random:tiny", "max_tokens": 2, "prompt": ["\\udfff"]}', "prompt.0"),
    ("/v1/completions", b'{"model": "random:tiny", "max_tokens": 2, "prompt": "ok", "stop": "\\ud800"}', "stop"),
])
def test_a_lone_surrogate_is_refused_naming_its_field(live, path, raw, param):
    error = error_of(post_raw(live, path, raw))
    assert error["param"] == param and error["code"] == "invalid_value"
    assert error["message"].startswith(f"{param}: contains a lone surrogate (U+D")
    assert "valid Unicode" in error["message"]
    still_serving(live)


def test_a_surrogate_pair_is_one_character_and_welcome(live):
    response = post_raw(live, "/v1/completions", b'{"model": "random:tiny", "max_tokens": 2, "prompt": "\\ud83d\\ude00"}')
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 5  # BOS + the emoji's 4 UTF-8 bytes


@pytest.mark.parametrize("raw", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "random:tiny", "prompt": "ok", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"model": "random:tiny", "prompt": "ok", "extra": ' + b'{"a": ' * 500 + b"1" + b"}" * 500 + b"}",
])
def test_a_body_nested_too_deeply_is_refused(live, raw):
    error = error_of(post_raw(live, "/v1/completions", raw))
    assert "nested too deeply" in error["message"] and error["code"] == "invalid_json"
    still_serving(live)


# -- chat messages without content ---------------------------------------------------------------

CHAT = {"model": MODEL, "max_tokens": 2}


@pytest.mark.parametrize("message, index, got", [
    ({"role": "user"}, 0, "missing"),
    ({"role": "user", "content": None}, 0, "null"),
    ({"role": "user", "content": []}, 0, "an empty list"),
    ({"role": "system"}, 0, "missing"),
])
def test_a_message_without_content_is_refused_naming_it(live, message, index, got):
    error = error_of(live.post("/v1/chat/completions", {**CHAT, "messages": [message]}))
    assert error["param"] == f"messages.{index}.content" and error["code"] == "invalid_value"
    assert error["message"].startswith(f"messages.{index}.content: ") and got in error["message"]
    still_serving(live)


def test_a_message_without_content_anywhere_in_the_history_is_refused(live):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    error = error_of(live.post("/v1/chat/completions", {**CHAT, "messages": messages}))
    assert error["param"] == "messages.2.content"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]
    error = error_of(live.post("/v1/chat/completions", {**CHAT, "messages": parts}))
    assert error["param"] == "messages.0.content.1.text"


def test_a_refused_message_leaves_its_session_as_it_was(live):
    first = live.post("/v1/chat/completions", {**CHAT, "user": "contentless",
                                               "messages": [{"role": "user", "content": "hello"}]})
    assert first.status_code == 200
    before = live.get("/v1/sessions/contentless").json()
    error_of(live.post("/v1/chat/completions", {**CHAT, "user": "contentless", "messages": [{"role": "user"}]}))
    assert live.get("/v1/sessions/contentless").json() == before


def test_an_empty_string_is_content(live):
    response = live.post("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": ""}]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


# -- fields on messages and content parts that nothing here honours -----------------------------------


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": "hi", "name": "bob"}], "messages.0.name"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
     "messages.0.content.0.cache_control"),
    ([{"role": "system", "content": "be brief", "weight": 2}, {"role": "user", "content": "hi"}], "messages.0.weight"),
])
def test_a_message_field_nothing_here_honours_is_refused_naming_it(live, messages, param):
    """They were dropped with a 200: a reply written as if the field had never been sent."""
    slots = live.get("/health").json()["sessions"]["slots_in_use"]
    error = error_of(live.post("/v1/chat/completions", {**CHAT, "user": "fields", "messages": messages}))
    assert (error["param"], error["code"]) == (param, "unsupported")
    assert error["message"].startswith(f"{param} is not supported by this server")
    assert live.get("/v1/sessions/fields").status_code == 404  # no session was started
    assert live.get("/health").json()["sessions"]["slots_in_use"] == slots
    assert live.post("/v1/completions", GOOD).status_code == 200


def test_a_message_field_that_is_empty_asks_for_nothing(live):
    """What a client sends back of an earlier reply (openai's message objects dump their unset
    fields as null) is accepted, as an empty unknown field of the body is."""
    messages = [{"role": "user", "content": "hi", "name": ""},
                {"role": "assistant", "content": "hello", "tool_calls": [], "refusal": None, "function_call": None},
                {"role": "user", "content": [{"type": "text", "text": "go on", "cache_control": None}]}]
    response = live.post("/v1/chat/completions", {**CHAT, "messages": messages})
    assert response.status_code == 200, response.text


def test_a_stream_option_nothing_here_honours_is_refused_naming_it(live):
    body = {**GOOD, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    error = error_of(live.post("/v1/completions", body))
    assert (error["param"], error["code"]) == ("stream_options.continuous_usage_stats", "unsupported")


# -- sampling values ------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", b"1e999"), ("temperature", b"-1e999"), ("temperature", b"NaN"), ("temperature", b"Infinity"),
    ("temperature", b"-0.5"), ("temperature", b"2.0001"), ("temperature", b'"1"'), ("temperature", b"true"),
    ("top_p", b"1e999"), ("top_p", b"-Infinity"), ("top_p", b"NaN"), ("top_p", b"0"), ("top_p", b"-1e-300"),
    ("top_p", b"1.0000001"), ("top_p", b"[0.5]"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_sampling_value_outside_the_api_range_is_refused_naming_it(live, field, value, stream):
    raw = (b'{"model": "random:tiny", "prompt": "ok", "max_tokens": 2, "stream": ' + json.dumps(stream).encode()
           + b', "' + field.encode() + b'": ' + value + b"}")
    error = error_of(post_raw(live, "/v1/completions", raw))
    assert error["param"] == field and error["message"].startswith(f"{field}: ")
    if value in (b"1e999", b"-1e999", b"NaN", b"Infinity", b"-Infinity"):
        assert "finite" in error["message"]


def read_stream(response: httpx.Response) -> tuple[list[dict], str]:
    """The JSON events of a completed stream and its text; fails unless it is well formed:
    `data: ` lines, each a JSON chunk, ending with `data: [DONE]`."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert all(event.startswith("data: ") for event in events)
    assert not any("error" in chunk for chunk in chunks), chunks
    return chunks, "".join(chunk["choices"][0]["text"] for chunk in chunks)


@pytest.mark.parametrize("sampling", [
    {"top_p": 1e-300}, {"temperature": 1e-30}, {"temperature": 2}, {"temperature": 2, "top_p": 1e-300},
    {"temperature": 1e-30, "top_p": 1e-300}, {"temperature": 0.0011, "top_p": 5e-324}, {"temperature": 0, "top_p": 1},
])
def test_sampling_at_the_edges_of_the_range_streams_a_whole_reply(live, sampling):
    body = {"model": MODEL, "prompt": "edge", "max_tokens": 24, "stream": True, "ignore_eos": True, **sampling}
    chunks, text = read_stream(live.post("/v1/completions", body))
    assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["positronic"]["tick"] == 24  # every token generated, none failed
    whole = live.post("/v1/completions", {**body, "stream": False})
    assert whole.status_code == 200 and whole.json()["choices"][0]["text"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**GOOD, "prompt": 3}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, "a"]}, "prompt.0"),  # as a list of strings, its first is wrong
    ("/v1/completions", {**GOOD, "stop": 3}, "stop"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": 3}]}]},
     "messages.0.content.0.type"),
])
def test_a_field_of_several_forms_is_named_without_the_form_tried(live, path, body, param):
    error = error_of(live.post(path, body))
    assert error["param"] == param and error["message"].startswith(f"{param}: ")


# -- other servers' switches: taken at the value this server acts on, refused at any other ------------

@pytest.mark.parametrize("path, fields, param, status", [
    ("/v1/chat/completions", {"add_generation_prompt": True}, None, 200),  # what a chat turn is here
    ("/v1/chat/completions", {"add_generation_prompt": False}, "add_generation_prompt", 400),
    ("/v1/chat/completions", {"add_generation_prompt": 1}, "add_generation_prompt", 400),
    ("/v1/chat/completions", {"skip_special_tokens": False}, None, 200),  # a reply's text keeps them
    ("/v1/chat/completions", {"skip_special_tokens": True}, "skip_special_tokens", 400),
    ("/v1/completions", {"skip_special_tokens": True}, "skip_special_tokens", 400),
    ("/v1/completions", {"add_generation_prompt": True}, "add_generation_prompt", 400),  # no chat, no prompt
])
def test_a_switch_is_taken_only_at_the_value_this_server_acts_on(live, path, fields, param, status):
    """add_generation_prompt: false was answered 200 with the assistant's prefix added anyway:
    a reply written as if the field had never been sent (vLLM's and llama-server's switches)."""
    chat = {**CHAT, "messages": [{"role": "user", "content": "hi"}]}
    body = {**chat, **fields} if path.endswith("chat/completions") else {**GOOD, **fields}
    response = live.post(path, body)
    assert response.status_code == status, response.text
    if status == 400:
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "unsupported")
