"""The server's tokenizer endpoints, the model card's context length, the API key, CORS and the
log level (positronic/server/app.py, tokens.py; `serve --api-key --cors-origin --log-level`):
real servers on the tiny random model, driven with httpx and the openai client."""

import subprocess
import threading
import time

import httpx
import openai
import pytest

from positronic.server import app as app_module

MODEL = "random:tiny"
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}]


# -- tokenize and detokenize --------------------------------------------------------------------

@pytest.mark.parametrize("text", ["Hello", "", " two  spaces\nand a line", "héllo wörld ✓ 🚀", "<s> typed"])
def test_tokenize_and_detokenize_are_the_tokenizers_own(live, tiny, server_config, text):
    answer = live.post("/tokenize", {"prompt": text, "model": MODEL}).json()
    assert answer == {"tokens": [tiny.bos_id] + tiny.encode(text), "count": 1 + len(tiny.encode(text)),
                      "max_model_len": server_config.budget}
    assert live.post("/tokenize", {"content": text}).json() == answer  # llama-server's name
    bare = live.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tiny.encode(text) == answer["tokens"][1:]
    assert live.post("/tokenize", {"content": text, "add_special": False}).json() == bare
    back = live.post("/detokenize", {"tokens": bare["tokens"], "model": MODEL}).json()
    assert back == {"prompt": tiny.decode(bare["tokens"]), "content": tiny.decode(bare["tokens"])}
    assert back["prompt"] == text


def test_a_tokenized_prompt_is_what_a_completion_prefills(live):
    counted = live.post("/tokenize", {"prompt": "Count me"}).json()["count"]
    usage = live.client().completions.create(model=MODEL, prompt="Count me", max_tokens=1).usage
    assert usage.prompt_tokens == counted


@pytest.mark.parametrize("messages", [CHAT[1:2], CHAT], ids=["one message", "a whole chat"])
def test_tokenized_messages_are_what_a_fresh_chat_session_prefills(live, tiny, messages):
    answer = live.post("/tokenize", {"messages": messages}).json()
    assert answer["tokens"][0] == tiny.bos_id and answer["count"] == len(answer["tokens"])
    session = f"tokenized-{len(messages)}"
    reply = live.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=4, user=session)
    assert reply.usage.prompt_tokens == answer["count"]
    prefilled = live.post("/detokenize", {"tokens": answer["tokens"]}).json()["prompt"]
    assert live.get(f"/v1/sessions/{session}").json()["transcript"].startswith(prefilled)
    assert all(m["content"] in prefilled for m in messages)
    bare = live.post("/tokenize", {"messages": messages, "add_special_tokens": False}).json()
    assert bare["tokens"] == answer["tokens"][1:]


def test_the_ids_of_tokenize_make_the_same_completion_prompt(live):
    """A client may send the ids /tokenize gave it as a completion's prompt: the same prefill."""
    ids = live.post("/tokenize", {"prompt": "By ids"}).json()["tokens"]
    by_ids = live.client().completions.create(model=MODEL, prompt=ids, max_tokens=6)
    by_text = live.client().completions.create(model=MODEL, prompt="By ids", max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)


MESSAGES = {"messages": CHAT[1:2]}


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/tokenize", b"{not json", 400, None, "invalid_json"),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt", "invalid_value"),
    ("/tokenize", {}, 400, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": None}, 400, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": ["a"]}, 400, "prompt", "invalid_value"),
    ("/tokenize", {"content": 5}, 400, "content", "invalid_value"),
    ("/tokenize", {"prompt": "a", "content": "a"}, 400, "content", "invalid_value"),
    ("/tokenize", {"prompt": "a", **MESSAGES}, 400, "messages", "invalid_value"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/tokenize", {"prompt": "a", "model": 3}, 400, "model", "invalid_value"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens", "invalid_value"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, 400, "add_special_tokens", "invalid_value"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": True, "add_special": False}, 400, "add_special",
     "invalid_value"),
    ("/tokenize", {"prompt": "a", "with_pieces": True}, 400, "with_pieces", "unsupported"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, 400, "return_token_strs", "unsupported"),
    ("/tokenize", {**MESSAGES, "add_generation_prompt": False}, 400, "add_generation_prompt", "unsupported"),
    ("/tokenize", {**MESSAGES, "continue_final_message": True}, 400, "continue_final_message", "unsupported"),
    ("/tokenize", {**MESSAGES, "chat_template": "{{ messages }}"}, 400, "chat_template", "unsupported"),
    ("/tokenize", {**MESSAGES, "tools": [{"type": "function"}]}, 400, "tools", "unsupported"),
    ("/tokenize", {"messages": []}, 400, "messages", "invalid_value"),
    ("/tokenize", {"messages": "hi"}, 400, "messages", "invalid_value"),
    ("/tokenize", {"messages": [{"role": "function", "content": "x"}]}, 400, "messages.0.role", "invalid_value"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages.0.content", "invalid_value"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0.content",
     "invalid_value"),
    ("/detokenize", b"[1, 2]", 400, None, "invalid_json"),
    ("/detokenize", {}, 400, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": [[1]]}, 400, "tokens.0", "invalid_value"),
    ("/detokenize", {"tokens": [1, 512]}, 400, "tokens.1", "invalid_value"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0", "invalid_value"),
    ("/detokenize", {"tokens": [2**64]}, 400, "tokens.0", "invalid_value"),
    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens.1", "invalid_value"),
    ("/detokenize", {"tokens": [1.0]}, 400, "tokens.0", "invalid_value"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens.0", "invalid_value"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model", "model_not_found"),
    # fields neither endpoint takes were dropped with a 200
    ("/tokenize", {"prompt": "a", "max_tokens": 3}, 400, "max_tokens", "unsupported"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a", "name": "bob"}]}, 400, "messages.0.name",
     "unsupported"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens", "unsupported"),
])
def test_bad_token_requests_get_an_openai_error(live, path, body, status, param, code):
    if isinstance(body, bytes):
        response = httpx.post(live.url + path, content=body, headers={"content-type": "application/json"})
    else:
        response = live.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")


def test_empty_fields_they_do_not_take_ask_for_nothing(live):
    assert live.post("/tokenize", {"prompt": "a", "max_tokens": None, "tools": []}).status_code == 200
    assert live.post("/detokenize", {"tokens": [1], "skip_special_tokens": False}).status_code == 200


def test_health_answers_while_a_large_prompt_is_tokenized(live, monkeypatch):
    """Tokenizing runs in the server's text thread, not on the event loop: /health answers while
    a 600 KB prompt is being tokenized. It used to wait for the whole of it (a 900 KB prompt held
    /health for 1.8 s). The tokenizing is held until /health has answered, so the order does not
    depend on how fast this machine tokenizes (timed, it failed once under load)."""
    from positronic.models.loading import LoadedModel

    encode, released, answered = LoadedModel.encode, threading.Event(), {}

    def held_encode(lm, text):  # the large prompt waits (in the text thread) until /health has answered
        if len(text) > 100_000:
            released.wait(30)
        return encode(lm, text)

    monkeypatch.setattr(LoadedModel, "encode", held_encode)

    def tokenize():
        with httpx.stream("POST", live.url + "/tokenize", json={"prompt": "hello world " * 50_000},
                          timeout=120) as response:
            answered["tokenize"] = time.monotonic()  # its status line and headers: the tokenizing is over
            assert response.status_code == 200
            response.read()

    client = threading.Thread(target=tokenize)
    client.start()
    try:
        deadline = time.monotonic() + 20
        while not live.server.open_requests:  # the request is in the server
            assert time.monotonic() < deadline, "the tokenize request never arrived"
            time.sleep(0.005)
        time.sleep(0.1)  # its body read (600 KB on a local socket: milliseconds): it is being tokenized
        started = time.monotonic()
        assert live.get("/health").status_code == 200
        answered["health"] = time.monotonic()
    finally:
        released.set()
        client.join(120)
    assert answered["health"] - started < 10  # not the 30 s the held tokenizing would have cost it
    assert answered["health"] < answered["tokenize"]


def test_token_endpoints_touch_no_session(live):
    before = live.get("/health").json()["sessions"]
    live.post("/tokenize", {"prompt": "no session", "user": "nobody"})
    live.post("/detokenize", {"tokens": [1, 2, 3]})
    assert live.get("/health").json()["sessions"] == before
    assert live.get("/v1/sessions/nobody").status_code == 404


def test_the_model_card_has_the_context_length(live, server_config):
    listed = live.client().models.list().data[0]
    assert listed.model_extra["max_model_len"] == server_config.budget
    card = live.get(f"/v1/models/{MODEL}").json()
    assert card == {"id": MODEL, "object": "model", "created": card["created"], "owned_by": "positronic",
                    "root": MODEL, "max_model_len": server_config.budget}


def test_served_model_names_are_the_ids_requests_name_and_answers_carry(tiny, tmp_path, live_server, server_settings,
                                                                         metric):
    """vLLM's --served-model-name: the server answers to each name (and no longer to the -m
    string), an answer carries the name its request gave, /v1/models lists them (root: the
    model behind them), /metrics labels vLLM's families with the first."""
    with live_server(tiny, server_settings(tmp_path, served_model_names=("gpt-tiny", "alias"))) as server:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["gpt-tiny", "alias"]
        assert server.get("/v1/models/alias").json()["root"] == MODEL
        assert client.completions.create(model="alias", prompt="hi", max_tokens=2).model == "alias"
        answer = client.chat.completions.create(model="gpt-tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2)
        assert answer.model == "gpt-tiny"
        for refused in (server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                        server.post("/tokenize", {"model": MODEL, "prompt": "hi"}), server.get(f"/v1/models/{MODEL}")):
            assert refused.status_code == 404 and MODEL in refused.json()["error"]["message"]
        assert server.post("/tokenize", {"model": "alias", "prompt": "hi"}).status_code == 200
        assert server.get("/health").json()["model"] == "gpt-tiny"
        assert metric(server.get("/metrics").text, "vllm:generation_tokens_total", model_name="gpt-tiny") == 4


def test_served_model_names_must_be_distinct_and_not_empty(tiny, tmp_path, server_settings, server_config):
    from positronic.server.app import create_app

    for bad in (("a", "a"), ("",), (" ",)):
        with pytest.raises(ValueError, match="served model names must be distinct, non-empty strings"):
            create_app(tiny, server_config, server_settings(tmp_path, served_model_names=bad))


# -- the API key ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def guarded(tiny, tmp_path_factory, live_server, server_settings):
    """A server that wants KEY, and lets ORIGIN call it from a browser."""
    with live_server(tiny, server_settings(tmp_path_factory.mktemp("guarded")), api_key=KEY,
                     cors_origins=[ORIGIN]) as server:
        yield server


GUARDED = [("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
           ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT[1:2], "max_tokens": 2}),
           ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None), ("GET", "/metrics", None),
           ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
           ("GET", "/v1/sessions/x", None), ("GET", "/nowhere", None), ("POST", "/health", None)]


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer wrong", f"Bearer {KEY}x",
                                           f"Bearer {KEY[:-1]}", f"Basic {KEY}", KEY])
@pytest.mark.parametrize("method, path, body", GUARDED, ids=[f"{m} {p}" for m, p, _ in GUARDED])
def test_without_the_key_every_endpoint_is_refused_with_401(guarded, method, path, body, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    before = guarded.server.in_flight, len(guarded.server.pool.loaded)
    response = httpx.request(method, guarded.url + path, json=body, headers=headers, timeout=30)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json() == {"error": {"message": response.json()["error"]["message"],
                                         "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    assert KEY not in response.text
    assert (guarded.server.in_flight, len(guarded.server.pool.loaded)) == before  # nothing ran


@pytest.mark.parametrize("method, path, body", GUARDED[:-2], ids=[f"{m} {p}" for m, p, _ in GUARDED[:-2]])
def test_with_the_key_every_endpoint_answers(guarded, method, path, body):
    for scheme in ("Bearer", "bearer"):
        response = httpx.request(method, guarded.url + path, json=body, timeout=30,
                                 headers={"Authorization": f"{scheme} {KEY}"})
        assert response.status_code == (404 if path == "/v1/sessions/x" else 200), response.text


def test_health_needs_no_key(guarded):
    assert httpx.get(guarded.url + "/health").json()["status"] == "ok"


def test_the_openai_client_with_the_key_works_and_without_it_is_refused(guarded):
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3).usage.completion_tokens == 3
    streamed = client.completions.create(model=MODEL, prompt="Stream", max_tokens=3, stream=True)
    assert len([chunk for chunk in streamed if chunk.choices and chunk.choices[0].text]) >= 1
    wrong = openai.OpenAI(base_url=guarded.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.code == "invalid_api_key"


def test_a_request_without_the_key_is_refused_before_its_body_is_read(guarded):
    too_big = {"model": MODEL, "prompt": "x" * (2 << 20)}  # over --max-body: 413 with the key
    assert httpx.post(guarded.url + "/v1/completions", json=too_big).status_code == 401
    assert httpx.post(guarded.url + "/v1/completions", json=too_big, headers=AUTH).status_code == 413


def test_refused_requests_are_counted(guarded, metric):
    def refused() -> float:
        text = httpx.get(guarded.url + "/metrics", headers=AUTH).text
        try:
            return metric(text, "positronic_requests_total", endpoint="/tokenize", status="401")
        except KeyError:  # none refused yet
            return 0

    before = refused()
    httpx.post(guarded.url + "/tokenize", json={"prompt": "hi"})
    assert refused() == before + 1


# -- CORS -------------------------------------------------------------------------------------------

PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-session-id"}


def test_no_cors_headers_unless_asked(live):
    preflight = httpx.options(live.url + "/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 405
    plain = httpx.get(live.url + "/v1/models", headers={"Origin": ORIGIN})
    assert plain.status_code == 200
    assert not [name for name in {**preflight.headers, **plain.headers} if name.startswith("access-control-")]


def test_an_allowed_origin_gets_cors_headers_and_its_preflight_needs_no_key(guarded):
    preflight = httpx.options(guarded.url + "/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    answered = httpx.get(guarded.url + "/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert answered.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.get(guarded.url + "/v1/models", headers={"Origin": ORIGIN})  # the page may read why
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_another_origin_gets_no_cors_headers(guarded):
    other = {**PREFLIGHT, "Origin": "https://evil.example"}
    preflight = httpx.options(guarded.url + "/v1/chat/completions", headers=other)
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
    plain = httpx.get(guarded.url + "/v1/models", headers={"Origin": other["Origin"], **AUTH})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


# -- the serve command ------------------------------------------------------------------------------

@pytest.fixture
def served(monkeypatch):
    """What `serve` passes to serve_forever (which returns at once). Its calls give --port 0:
    serve binds its address for a moment before the model loads, and 8080 may be taken."""
    calls = []
    monkeypatch.setattr(app_module, "serve_forever", lambda *args, **kwargs: calls.append(kwargs) or 0)
    return calls


def test_serve_passes_its_access_and_log_flags_on(tmp_path, run_cli, served, monkeypatch):
    monkeypatch.delenv("POSITRONIC_API_KEY", raising=False)
    assert run_cli("serve", "-m", MODEL, "--port", "0", "--session-dir", str(tmp_path)) == 0
    assert (served[-1]["api_key"], tuple(served[-1]["cors_origins"]), served[-1]["log_level"]) == (None, (), "info")
    assert run_cli("serve", "-m", MODEL, "--port", "0", "--session-dir", str(tmp_path), "--api-key", KEY,
                   "--cors-origin", ORIGIN, "--cors-origin", "http://localhost:3000", "--log-level", "DEBUG") == 0
    assert served[-1]["api_key"] == KEY and served[-1]["log_level"] == "debug"
    assert list(served[-1]["cors_origins"]) == [ORIGIN, "http://localhost:3000"]
    monkeypatch.setenv("POSITRONIC_API_KEY", "from-the-environment")
    assert run_cli("serve", "-m", MODEL, "--port", "0", "--session-dir", str(tmp_path)) == 0
    assert served[-1]["api_key"] == "from-the-environment"
    assert run_cli("serve", "-m", MODEL, "--port", "0", "--session-dir", str(tmp_path), "--api-key", KEY) == 0
    assert served[-1]["api_key"] == KEY  # the flag wins


@pytest.mark.parametrize("flags, says", [
    (("--api-key", ""), "--api-key"), (("--api-key", "two words"), "--api-key"), (("--api-key", "clé"), "--api-key"),
    (("--cors-origin", "https://app.example/"), "is not an origin"),
    (("--cors-origin", "app.example"), "is not an origin"),
    (("--log-level", "loud"), "loud"),
])
def test_serve_refuses_bad_access_and_log_flags(tmp_path, run_cli, served, capsys, flags, says):
    assert run_cli("serve", "-m", MODEL, "--port", "0", "--session-dir", str(tmp_path), *flags) == 2
    err = capsys.readouterr().err
    assert says in err and not served
    if flags[0] == "--api-key" and flags[1]:
        assert flags[1] not in err  # a key is never echoed


def test_a_serve_process_takes_its_key_from_the_environment_and_its_log_level(tmp_path, serve_process,
                                                                              monkeypatch):
    """At --log-level warning uvicorn keeps its INFO lines (its address among them) to itself:
    the address is still printed, and no INFO line is, from uvicorn or the server."""
    monkeypatch.setenv("POSITRONIC_API_KEY", KEY)
    process, url = serve_process("--log-level", "warning", "--session-dir", str(tmp_path), "-t", "1")
    try:
        assert httpx.get(url + "/v1/models").status_code == 401
        models = httpx.get(url + "/v1/models", headers=AUTH).json()
        assert models["data"][0]["max_model_len"] == 512  # serve's default budget
        assert httpx.get(url + "/health").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="logged").usage.total_tokens
    finally:
        process.terminate()
        try:
            rest = process.communicate(timeout=30)[1]  # what it wrote after the address
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode in (0, -15), rest
    assert "INFO" not in rest and KEY not in rest
    assert (tmp_path / "logged").is_dir()  # it did shut down as usual: the session was saved
