"""`n` > 1 (positronic/server/choices.py): several choices for one request, each a throwaway
sequence; choice i is what the same request with n = 1 and seed + i answers. Driven with the
official openai client and raw HTTP against a live server on the tiny random model."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from positronic.server.schemas import APIError

MODEL = "random:tiny"
HOT = dict(temperature=1.5, top_p=1.0)  # sampled: different seeds give different replies


def test_each_choice_is_the_single_request_with_its_own_seed(live):
    client = live.client()
    three = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=10, n=3, seed=11, **HOT)
    alone = [client.completions.create(model=MODEL, prompt="Once upon", max_tokens=10, seed=11 + i, **HOT)
             for i in range(3)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in three.choices}) > 1, "sampled choices with other seeds should differ"
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens
    states = three.model_extra["positronic"]["choices"]
    assert len(states) == 3 and all(state["session"] is None for state in states)


def test_a_list_of_prompts_answers_each_as_its_own_request(live):
    """vLLM's and OpenAI's batched completion: choice i * n + j is prompt i alone with seed + j;
    usage counts each prompt once; strings and token lists alike; streamed the same."""
    client = live.client()
    prompts = ["Once upon", "The sea was", "In the"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2, seed=5, **HOT)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, seed=5 + j, **HOT)
             for p in prompts for j in range(2)]
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone[::2])
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = [[1, 40, 41, 42], [1, 90, 91]]
    tokens = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in tokens.choices] == [client.completions.create(model=MODEL, prompt=p, max_tokens=4,
                                                                          temperature=0).choices[0].text for p in ids]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2, seed=5, stream=True,
                                            stream_options={"include_usage": True}, **HOT))
    texts = [""] * 6
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in batch.choices]
    assert chunks[-1].usage.prompt_tokens == batch.usage.prompt_tokens


def test_lm_evals_batched_loglikelihood_request_scores_each_prompt_as_alone(live):
    """lm-eval's local-completions above batch size 1: token lists, echo, logprobs, one new token;
    each choice's prompt log-probabilities are those of the prompt sent alone."""
    prompts = [[1, 40, 41, 42, 43], [1, 90, 91, 92], [1, 7, 8]]
    body = {"model": MODEL, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    batch = live.post("/v1/completions", {**body, "prompt": prompts}).json()
    alone = [live.post("/v1/completions", {**body, "prompt": p}).json()["choices"][0] for p in prompts]
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["logprobs"]["token_logprobs"] for c in batch["choices"]] == [a["logprobs"]["token_logprobs"]
                                                                           for a in alone]
    assert [c["text"] for c in batch["choices"]] == [a["text"] for a in alone]


def test_without_a_seed_choice_0_is_what_n_1_answers(live, chat):
    client = live.client()
    two = chat(client, None, "Tell me more", max_tokens=8, n=2, **HOT)
    one = chat(client, None, "Tell me more", max_tokens=8, **HOT)
    assert two.choices[0].message.content == one.choices[0].message.content
    assert two.choices[1].message.content != one.choices[0].message.content
    assert [c.message.role for c in two.choices] == ["assistant", "assistant"]


def test_streamed_choices_carry_their_index_one_id_and_one_usage(live):
    client = live.client()
    whole = client.completions.create(model=MODEL, prompt="Streams", max_tokens=9, n=2, seed=3, **HOT)
    chunks = list(client.completions.create(model=MODEL, prompt="Streams", max_tokens=9, n=2, seed=3, stream=True,
                                            stream_options={"include_usage": True}, **HOT))
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    assert len({chunk.id for chunk in chunks}) == 1
    usages = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usages) == 1 and chunks[-1].usage is not None and not chunks[-1].choices
    assert usages[0].completion_tokens == whole.usage.completion_tokens
    finished = [choice.index for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert sorted(finished) == [0, 1]


def test_a_streamed_chat_opens_every_choice_and_ends_once(live):
    response = live.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 4, "n": 3, "stream": True, **HOT})
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(event) for event in events[:-1]]
    roles = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role") == "assistant")
    assert roles == [0, 1, 2]
    assert not any("usage" in c and c["usage"] for c in chunks)  # not asked for


def test_the_choices_share_forwards(live):
    """The choices are sequences of one batch: their ticks went through shared forwards."""
    before = live.metric("positronic_batch_sequences_sum")
    forwards = live.metric("positronic_batch_sequences_count")
    response = live.post("/v1/completions", {"model": MODEL, "prompt": "together", "max_tokens": 12, "n": 4,
                                             "seed": 1, "ignore_eos": True, **HOT})
    assert response.status_code == 200 and len(response.json()["choices"]) == 4
    fed = live.metric("positronic_batch_sequences_sum") - before
    ran = live.metric("positronic_batch_sequences_count") - forwards
    assert fed / ran > 1.5, f"{fed} sequences in {ran} forwards: the choices did not share them"


@pytest.mark.parametrize("body, headers, param, words", [
    ({"n": 2, "user": "s1"}, {}, "n", "without a session"),
    ({"n": 2}, {"X-Session-Id": "s1"}, "n", "without a session"),
    ({"n": 2}, {"Idempotency-Key": "k1"}, "n", "Idempotency-Key"),
    ({"n": 0}, {}, "n", "n must be in 1.."),
    ({"n": 10_000}, {}, "n", "n must be in 1.."),
    ({"n": 2, "seed": 2**63 - 1}, {}, "seed", "past 2**63 - 1"),
    ({"best_of": 2}, {}, "best_of", "best_of 1"),
    ({"prompt": ["a", "b"], "user": "s1"}, {}, "prompt", "a list of prompts is for requests without a session"),
    ({"prompt": ["a", "b"]}, {"Idempotency-Key": "k1"}, "prompt", "Idempotency-Key"),
    ({"prompt": ["a"] * 9, "n": 2}, {}, "prompt", "9 prompts x n = 2 are 18 sequences, above this server's 16"),
])
def test_choices_that_cannot_run_are_refused_and_nothing_is_held(live, body, headers, param, words):
    sessions = len(live.server.pool.loaded)
    response = live.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **body},
                         headers=headers)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"]
    assert len(live.server.pool.loaded) == sessions and live.server.in_flight == 0


def test_choices_past_the_servers_room_are_refused_and_the_begun_ones_let_go(tiny, tmp_path, live_server,
                                                                             server_settings):
    """With room for two sequences, one held by a long request, n = 2 gets a 429 and the
    choice that did begin lets go of its place and its conversation."""
    with live_server(tiny, server_settings(tmp_path, max_sessions=2, max_pending=8)) as server:
        long = threading.Thread(target=server.post, args=("/v1/completions", {
            "model": MODEL, "prompt": "long", "max_tokens": 200, "ignore_eos": True, "user": "busy"}))
        long.start()
        try:
            deadline = time.monotonic() + 20
            while server.server.in_flight == 0:
                assert time.monotonic() < deadline, "the long request never started"
                time.sleep(0.01)
            refused = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 2})
        finally:
            long.join()
        assert refused.status_code == 429, refused.text
        assert server.server.in_flight == 0 and server.server.pool._throwaway == 0
        ok = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_a_choice_that_fails_after_another_began_lets_that_one_go(live, monkeypatch):
    """Choice 1 fails once choice 0 has its conversation and its prompt read: the request gets
    choice 1's error, and choice 0's place and throwaway conversation are let go (a fault
    injected into the server's own _begin, which every request goes through)."""
    server = live.server
    begin, calls = server._begin, []

    async def failing_second(request, body, chat):
        calls.append(body.seed)
        if len(calls) == 2:
            await asyncio.sleep(0.3)  # choice 0 has begun by then
            raise APIError(503, "injected", type="server_error")
        return await begin(request, body, chat)

    monkeypatch.setattr(server, "_begin", failing_second)
    response = live.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 2, "seed": 5})
    assert response.status_code == 503 and response.json()["error"]["message"] == "injected"
    assert calls == [5, 6]
    assert server.in_flight == 0 and server.pool._throwaway == 0


def test_a_client_that_leaves_a_stream_of_choices_stops_every_choice(live):
    """The client reads a few chunks of a long n = 3 stream and hangs up: every choice stops
    ticking and lets go of its place and its conversation."""
    server = live.server
    body = {"model": MODEL, "prompt": "long", "max_tokens": 1500, "ignore_eos": True, "n": 3, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        seen = {json.loads(line[len("data: "):])["choices"][0]["index"] for line, _ in zip(
            (line for line in lines if line.startswith("data: {")), range(30))}
    assert seen == {0, 1, 2}
    deadline = time.monotonic() + 10
    while (server.in_flight or server.pool._throwaway) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.in_flight == 0 and server.pool._throwaway == 0
    ticks = live.metric("positronic_ticks_total")
    time.sleep(0.5)
    assert live.metric("positronic_ticks_total") == ticks, "a choice kept ticking after its client left"
