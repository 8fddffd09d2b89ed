"""Requests fuzzed with hypothesis against one live server on the tiny random model: every
answer is a 2xx with a well-formed body (a stream: JSON chunks ending in `data: [DONE]`) or a
4xx in OpenAI's error shape, never a 5xx and never a hang; nothing is written outside the
session directory, and no request leaves a session slot held.

Bodies mix the fields' right types and wrong ones, values at and past the limits (max_tokens,
the budget, stop strings, the body size), text with NUL and lone surrogates (json.dumps writes a
lone surrogate as a raw "\\udXXX" escape), unknown fields, and session ids with path tricks
("../x", "a/b", "."), in the `user` field or the X-Session-Id header.

POSITRONIC_FUZZ_EXAMPLES (default 60; 2000 with POSITRONIC_LONG_TESTS=1) sets how many requests hypothesis tries; the run's
figures (requests, outcomes by status, time) are printed at the end (`pytest -s`); a long run's
are in bench/results/server.md.
"""

import collections
import json
import os
import re
import time

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

MODEL = "random:tiny"
EXAMPLES = int(os.environ.get("POSITRONIC_FUZZ_EXAMPLES", "2000" if os.environ.get("POSITRONIC_LONG_TESTS") else "60"))
MAX_TOKENS = 24  # the fuzzed server's --max-tokens: replies stay short
MAX_BODY = 16 * 1024
REQUEST_TIMEOUT = 60  # seconds: a request that takes longer is a hang
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
OUTCOMES: collections.Counter = collections.Counter()


@pytest.fixture(scope="module")
def fuzzed(tiny, tmp_path_factory, live_server, server_settings):
    root = tmp_path_factory.mktemp("fuzz")
    settings = server_settings(root, max_tokens=MAX_TOKENS, default_max_tokens=6, max_body_bytes=MAX_BODY,
                               max_sessions=4)
    start = time.perf_counter()
    with live_server(tiny, settings) as server:
        yield server, root
    seconds = time.perf_counter() - start
    total = sum(v for k, v in OUTCOMES.items() if k.endswith("xx"))
    print(f"\nfuzz: {total} requests in {seconds:.1f} s; " + ", ".join(f"{k} {v}" for k, v in sorted(OUTCOMES.items())))


# -- strategies -------------------------------------------------------------------------------------

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)  # hypothesis leaves them out unless asked
CHARS = st.one_of(*[st.characters()] * 5, SURROGATES, st.just("\x00"), st.sampled_from("<|im_end|></s>\n\t "))
TEXT = st.one_of(st.text(CHARS, max_size=40), st.just(""), st.text(st.sampled_from("ab "), min_size=80, max_size=200))
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                         st.text(CHARS, max_size=10))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(CHARS, max_size=6), inner,
                                                                          max_size=3)), max_leaves=8)
VALID = {  # fields a request may give, each with values the API takes
    "max_tokens": st.integers(1, MAX_TOKENS),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0.0, 1e-30, 1e-3, 2.0])),
    "top_p": st.one_of(st.floats(5e-324, 1), st.sampled_from([5e-324, 1e-300, 1.0])),
    "seed": st.integers(0, 2**63 - 1),
    "n": st.just(1),
    "stop": st.one_of(st.text(CHARS, max_size=4), st.lists(st.text(CHARS, max_size=3), max_size=4),
                      st.text(st.just("z"), min_size=256, max_size=256)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "user": st.sampled_from(["s1", "s2", "s3", "s4", "s5", "x" * 64, "-", "_"]),
    "frequency_penalty": st.floats(-2, 2),  # accepted and ignored
}
INVALID = {  # values past the limits or of the wrong type
    "max_tokens": st.one_of(st.integers(-2, 0), st.just(MAX_TOKENS + 1), st.integers(2**31, 2**80), st.just(1.5),
                            st.just("3"), st.just(True)),
    "max_completion_tokens": st.one_of(st.integers(-1, 0), st.just(MAX_TOKENS + 1), st.just("x")),
    "temperature": st.sampled_from([2.0000001, -1e-9, -1.0, float("inf"), float("-inf"), float("nan"), 1e300, "1",
                                    [0.5]]),
    "top_p": st.sampled_from([0.0, -0.0, 1.0000001, float("-inf"), float("nan"), -1e-300, None, True]),
    "seed": st.sampled_from([-1, 2**63, 2**64, 0.5, "7"]),
    "n": st.sampled_from([0, -1, "1", 10_000]),
    "best_of": st.sampled_from([2, 0]),
    "stop": st.one_of(st.lists(st.just("s"), min_size=5, max_size=6), st.text(st.just("z"), min_size=257,
                                                                             max_size=257), st.just(3)),
    "stream": st.sampled_from([1, "true", None, {}]),
    "stream_options": st.sampled_from([1, [], {"include_usage": "yes"}]),
    "ignore_eos": st.sampled_from([1, "no"]),
    "user": st.sampled_from(["../x", "a/b", ".", "..", "", "x" * 65, "ä", "a b", "a\x00b", "/etc/passwd",
                             "s1/../../escape", "~", 5, ["s1"]]),
    "model": st.one_of(st.sampled_from(["gpt-4", "", "random:tiny ", 3, None]), st.text(CHARS, max_size=8)),
    "logprobs": st.sampled_from([True, 5]),
    "echo": st.just(True),
    "tools": st.just([{"type": "function"}]),
    "logit_bias": st.just({"5": 10}),
    "suffix": st.just("x"),
}
HEADER_SESSIONS = st.sampled_from(["s1", "s2", "../x", "a/b", ".", "..", "x" * 65, "%2e%2e", "s1."])
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
BAD_PART = st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "", 3])},
                                 optional={"text": st.one_of(TEXT, st.none(), st.integers())})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "user", "system", "developer"]),
                                 "content": st.one_of(TEXT, TEXT, st.lists(PART, min_size=1, max_size=3))},
                                optional={"name": TEXT})
BAD_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["function", "", 3, None])}, optional={"content": TEXT}),
    st.fixed_dictionaries({"role": st.just("tool")}),  # a tool's answer without its content
    st.fixed_dictionaries({"role": st.just("user")}, optional={"content": st.one_of(st.none(), st.just([]),
                                                                                    st.lists(BAD_PART, min_size=1,
                                                                                             max_size=2),
                                                                                    JSON_SCALARS)}),
    JSON_SCALARS)
PROMPT = st.one_of(TEXT, TEXT, st.lists(TEXT, min_size=1, max_size=1), st.lists(st.integers(0, 511), max_size=90),
                   st.lists(st.lists(st.integers(0, 511), max_size=20), min_size=1, max_size=1))
BAD_PROMPT = st.one_of(st.lists(TEXT, min_size=2, max_size=3), st.lists(st.integers(-2, 600), min_size=1, max_size=5)
                       .filter(lambda ids: any(not 0 <= i < 512 for i in ids)), st.just([]),
                       st.lists(st.integers(0, 511), min_size=100, max_size=130), st.text(st.just("y"), min_size=100,
                                                                                       max_size=120), JSON_SCALARS)


@st.composite
def requests(draw):
    """(path, raw body, headers) of one request: a valid one, or one with a few fields gone wrong."""
    chat = draw(st.booleans())
    body = {"model": MODEL}
    if chat:
        history = draw(st.lists(MESSAGE, max_size=2)) + [{**draw(MESSAGE), "role": "user"}]  # ends with the user
        if draw(st.integers(0, 3)) == 3:  # an earlier exchange: the session reads only what follows the reply
            history[-1:-1] = [{"role": "assistant", "content": draw(TEXT)}]
        body["messages"] = history
    else:
        body["prompt"] = draw(PROMPT)
    for name in draw(st.sets(st.sampled_from(sorted(VALID)), max_size=len(VALID))):
        body[name] = draw(VALID[name])
    if draw(st.integers(0, 9)) >= 6:  # a few things wrong (hypothesis starts at 0: valid)
        for name in draw(st.sets(st.sampled_from(sorted(INVALID) + ["input", "input", "unknown"]), min_size=1,
                                 max_size=3)):
            if name == "input":
                if chat:
                    messages = draw(st.lists(st.one_of(MESSAGE, BAD_MESSAGE), max_size=2)) + [draw(BAD_MESSAGE)]
                    body["messages"] = draw(st.sampled_from([messages, messages, [], None, "hi", {"role": "user"}]))
                else:
                    body["prompt"] = draw(BAD_PROMPT)
            elif name == "unknown":
                body.update(draw(st.dictionaries(st.text(CHARS, max_size=8), JSON, min_size=1, max_size=3)))
            else:
                body[name] = draw(INVALID[name])
        if draw(st.integers(0, 4)) == 4:
            del body["prompt" if "prompt" in body else "messages"]
    headers = {"content-type": "application/json"}
    if draw(st.integers(0, 5)) == 5:
        headers["x-session-id"] = draw(HEADER_SESSIONS)
    raw = json.dumps(body).encode()  # ensure_ascii: a lone surrogate goes out as a raw escape
    shape = draw(st.integers(0, 24))
    if shape == 23:  # near and past the body limit
        pad = MAX_BODY - len(raw) + draw(st.integers(-64, 64)) - len(b', "pad": ""')
        raw = raw[:-1] + b', "pad": "' + b"p" * max(0, pad) + b'"}'
    elif shape == 24:
        raw = draw(st.sampled_from([b"", b"{", b"[]", b"null", b'"x"', b"{" * 5000, b"[" * 50_000, b"\xff\xfe",
                                    b'{"model": "random:tiny", "prompt": "a\\ud800"}', b"1e999"]))
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw, headers


# -- checks ----------------------------------------------------------------------------------------

def check_error(response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    assert error["message"]


def check_stream(response: httpx.Response, chat: bool) -> None:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.text.split("\n\n") if e]
    assert events and events[-1] == "data: [DONE]", events[-3:]
    for event in events[:-1]:
        assert event.startswith("data: ")
        chunk = json.loads(event.removeprefix("data: "))
        assert "error" not in chunk, chunk  # a failure after the first byte: a 5xx in disguise
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")


def check_whole(response: httpx.Response, chat: bool) -> None:
    answer = response.json()
    assert answer["object"] == ("chat.completion" if chat else "text_completion")
    (choice,) = answer["choices"]
    assert choice["finish_reason"] in ("stop", "length")
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str)
    usage = answer["usage"]
    assert 0 < usage["completion_tokens"] <= MAX_TOKENS and usage["total_tokens"] == usage["prompt_tokens"] + \
        usage["completion_tokens"]
    assert answer["positronic"]["live_length"] <= answer["positronic"]["budget"]


JSON_TYPE = {"content-type": "application/json"}


def known(path: str, raw: bytes, headers: dict = JSON_TYPE) -> tuple[str, bytes, dict]:
    return path, raw, headers


@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 60,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(request=requests())
# requests that once got a 5xx, tried on every run besides what hypothesis draws
@example(request=known("/v1/completions", b'{"model": "random:tiny", "max_tokens": 2, "prompt": "a\\ud800b"}'))
@example(request=known("/v1/chat/completions", b'{"model": "random:tiny", "max_tokens": 2, "user": "s1", "messages": '
                                               b'[{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'))
@example(request=known("/v1/completions", b"[" * 100_000 + b"]" * 100_000))
@example(request=known("/v1/completions", b'{"model": "random:tiny", "max_tokens": 3, "prompt": "a\\u0000b", '
                                          b'"user": "s2"}'))
@example(request=known("/v1/chat/completions", b'{"model": "random:tiny", "messages": [{"role": "user", '
                                               b'"content": null}]}'))
@example(request=known("/v1/completions", b'{"model": "random:tiny", "prompt": "x", "temperature": 1e999}'))
@example(request=known("/v1/completions", b'{"model": "random:tiny", "prompt": "x", "max_tokens": 24, "stream": true, '
                                          b'"temperature": 2, "top_p": 1e-300, "ignore_eos": true}'))
@example(request=known("/v1/completions", b'{"model": "random:tiny", "prompt": "x"}', {**JSON_TYPE,
                                                                                       "x-session-id": "../x"}))
def test_fuzzed_requests_get_a_well_formed_answer_or_a_4xx(fuzzed, request):
    server, _ = fuzzed
    path, raw, headers = request
    try:
        response = httpx.post(server.url + path, content=raw, headers=headers, timeout=REQUEST_TIMEOUT)
    except httpx.TimeoutException:
        OUTCOMES["hang"] += 1
        raise AssertionError(f"no answer in {REQUEST_TIMEOUT} s: {raw[:300]!r}") from None
    OUTCOMES[f"{response.status_code // 100}xx"] += 1
    OUTCOMES[str(response.status_code)] += 1
    if os.environ.get("POSITRONIC_FUZZ_DEBUG") and response.status_code >= 400:
        error = response.json().get("error", {})
        OUTCOMES[f"{response.status_code} {error.get('code')} {error.get('param')}"] += 1
    assert response.status_code < 500, (response.status_code, response.text[:500], raw[:300])
    chat = path == "/v1/chat/completions"
    if response.status_code >= 400:
        check_error(response)
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(response, chat)
    else:
        assert response.status_code == 200
        check_whole(response, chat)
    assert server.get("/health").json()["sessions"]["slots_in_use"] <= 4
    assert server.get("/health").json()["requests_in_flight"] == 0


def test_the_fuzzing_wrote_nothing_outside_the_session_directory(fuzzed):
    """After the fuzzing (this module's tests run in order) the server stops, checkpointing its
    sessions; every file under its temporary root then lies in sessions/ID/ with a well-formed ID."""
    server, root = fuzzed
    assert OUTCOMES["2xx"] >= min(EXAMPLES, 60) // 4 and OUTCOMES["4xx"], OUTCOMES  # both kinds were exercised
    server.__exit__(None, None, None)  # a graceful stop (the fixture's own stop after it does nothing more)
    assert server.server.closed and server.server.lost == {}
    files = [path for path in root.rglob("*") if path.is_file()]
    assert files, "no session was ever checkpointed"
    for path in root.rglob("*"):
        relative = path.relative_to(root).parts
        assert relative[0] == "sessions", path
        if len(relative) >= 2 and relative[1] != ".lock":  # the directory's lock file (sessions.locked)
            assert SESSION_ID.fullmatch(relative[1]), path
        assert len(relative) <= 3, path
