"""A session's live context never passes its budget, whatever the policy: a policy that
evicts makes room tick by tick; one that evicts nothing (`none` with at_capacity stop) ends a
reply at the budget (finish_reason "length") and refuses input it has no room for with a 400
(context_length_exceeded), leaving the session as it was, still saved at shutdown.
"""

import json

import httpx
import pytest

from positronic.brain import session as sessions
from positronic.brain.chat import turn_limit
from positronic.brain.loop import BrainConfig

MODEL = "random:tiny"
BUDGET = 64


def config_of(policy: str, at_capacity: str = "stop") -> BrainConfig:
    return BrainConfig(policy=policy, at_capacity=at_capacity, budget=BUDGET, temperature=0.0, seed=0)


def streamed(response: httpx.Response) -> tuple[str, str, dict]:
    """(text, finish reason, positronic extension) of a completed stream (ends in [DONE])."""
    assert response.status_code == 200, response.text
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(c.get("text", c.get("delta", {}).get("content", "")) or "" for c in choices)
    return text, choices[-1]["finish_reason"], chunks[-1]["positronic"]


def request(server, i: int, size: int, max_tokens: int, stream: bool) -> tuple[httpx.Response, dict | None]:
    """Request `i` of session "s": a completion or a chat turn of about `size` tokens; the
    response and the session's state after it (None when refused)."""
    body = {"model": MODEL, "max_tokens": max_tokens, "user": "s", "ignore_eos": True, "stream": stream}
    if i % 2:
        path, body = "/v1/completions", {**body, "prompt": "x" * size}
    else:
        path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "y" * max(1, size - 20)}]}
    response = server.post(path, body)
    if response.status_code != 200:
        return response, None
    if stream:
        return response, streamed(response)[2]
    return response, response.json()["positronic"]


def test_policy_none_stop_fills_once_then_refuses_and_the_session_survives(tiny, tmp_path, live_server,
                                                                           server_settings):
    """The loop that used to grow a none/stop session past its budget (64 -> 500+, then a 500
    and the session lost at shutdown): every response is a 200 within the budget or the
    session-full 400, and the saved session resumes as the server last described it."""
    settings = server_settings(tmp_path)
    with live_server(tiny, settings, config_of("none", "stop")) as server:
        statuses, last = [], None
        for i in range(14):
            response, state = request(server, i, size=6, max_tokens=8, stream=i % 3 == 2)
            statuses.append(response.status_code)
            if state is not None:
                assert state["live_length"] <= BUDGET, (i, state)
                last = state
                continue
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] in ("prompt", "messages")
            assert "full" in error["message"] and "policy none" in error["message"]
            assert "at_capacity stop" in error["message"] and "new session" in error["message"]
            assert server.get("/v1/sessions/s").json()["tick"] == last["tick"]  # left as it was
        assert last["live_length"] == BUDGET, "the session never filled: the test proves nothing"
        assert statuses[-1] == 400 and set(statuses) == {200, 400}
        described = server.get("/v1/sessions/s").json()
        assert described["live_length"] <= BUDGET
    brain = sessions.resume(tiny, settings.session_dir / "s")
    assert (brain.tick, brain.state.rows_per_layer) == (described["tick"], described["live_length"])
    assert brain.state.rows_per_layer <= BUDGET


def test_policy_none_stop_ends_a_reply_at_the_budget_with_length(tiny, tmp_path, live_server, server_settings):
    with live_server(tiny, server_settings(tmp_path), config_of("none", "stop")) as server:
        body = {"model": MODEL, "prompt": "fill", "max_tokens": 500, "user": "s", "ignore_eos": True}
        whole = server.post("/v1/completions", body).json()
        assert whole["choices"][0]["finish_reason"] == "length"
        assert whole["positronic"]["live_length"] == BUDGET
        assert whole["usage"]["prompt_tokens"] + whole["usage"]["completion_tokens"] == BUDGET
        refused = server.post("/v1/completions", {**body, "prompt": ""})  # no input: still a row for the reply
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        # a fresh brain keeps a row for its reply: a prompt of the whole budget is refused
        over = server.post("/v1/completions", {"model": MODEL, "prompt": [1] * BUDGET, "max_tokens": 1})
        assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
        text, reason, state = streamed(server.post("/v1/completions", {"model": MODEL, "prompt": [1] * (BUDGET - 1),
                                                                       "max_tokens": 5, "stream": True}))
        assert (reason, state["live_length"]) == ("length", BUDGET)


@pytest.mark.parametrize("policy, at_capacity", [("streaming", "stop"), ("h2o", "stop"), ("scored", "stop"),
                                                 ("brightness", "stop"), ("none", "shift"), ("none", "stop")])
def test_every_policy_keeps_a_session_within_its_budget(tiny, tmp_path, live_server, server_settings, policy,
                                                        at_capacity):
    config = config_of(policy, at_capacity)
    limit = turn_limit(config)
    plan = [(limit, 40), (limit // 2, 30), (limit - 1, 1), (limit, 50), (3, 40), (limit, 2), (1, 1)]
    with live_server(tiny, server_settings(tmp_path), config) as server:
        answered = 0
        for i, (size, max_tokens) in enumerate(plan):
            response, state = request(server, i, size, max_tokens, stream=i % 2 == 1)
            if state is None:  # only a session that evicts nothing may be full
                assert (policy, at_capacity) == ("none", "stop"), response.text
                assert response.json()["error"]["code"] == "context_length_exceeded"
            else:
                answered += 1
                assert state["live_length"] <= BUDGET, (i, state)
            assert server.get("/v1/sessions/s").json()["live_length"] <= BUDGET
        assert answered == (1 if (policy, at_capacity) == ("none", "stop") else len(plan))
