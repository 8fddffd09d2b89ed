"""curl, a client nobody here wrote, on the error paths: each answer is the OpenAI error shape
with the status, param and code a script can act on."""

import json
import shutil
import subprocess

import pytest

MODEL = "random:tiny"

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def curl(url: str, body: str, *headers: str) -> tuple[int, dict]:
    args = ["curl", "-s", "-w", "\n%{http_code}", "-H", "Content-Type: application/json", "-d", body]
    for header in headers:
        args += ["-H", header]
    out = subprocess.run(args + [url], capture_output=True, text=True, timeout=60, check=True).stdout
    text, status = out.rsplit("\n", 1)
    return int(status), json.loads(text)


@pytest.mark.parametrize("body, status, param, code", [
    ('{"model": "random:tiny", "prompt": "hi", "temperature": "hot"}', 400, "temperature", "invalid_value"),
    ('{"model": "random:tiny", "prompt": "hi", "frobnicate": 3}', 400, "frobnicate", "unsupported"),
    ('{"model": "random:tiny", "prompt": "' + "x" * 600 + '"}', 400, "prompt", "context_length_exceeded"),
    ('{"model": "random:tiny", "prompt": [1, 2', 400, None, "invalid_json"),
])
def test_curl_gets_openai_errors_for_bad_requests(live, body, status, param, code):
    got, answer = curl(live.url + "/v1/completions", body)
    assert got == status and set(answer["error"]) == {"message", "type", "param", "code"}
    assert (answer["error"]["param"], answer["error"]["code"]) == (param, code)


def test_curl_gets_401_for_a_bad_key_and_an_over_budget_turn_is_400(tiny, tmp_path, live_server, server_settings):
    with live_server(tiny, server_settings(tmp_path), api_key="s3cret") as server:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                           "user": "c1"})
        got, answer = curl(server.url + "/v1/chat/completions", body, "Authorization: Bearer wrong")
        assert got == 401 and answer["error"]["code"] == "invalid_api_key"
        key = "Authorization: Bearer s3cret"
        assert curl(server.url + "/v1/chat/completions", body, key)[0] == 200
        over = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "z" * 200}], "user": "c1"})
        got, answer = curl(server.url + "/v1/chat/completions", over, key)
        assert got == 400 and answer["error"]["code"] == "context_length_exceeded"
