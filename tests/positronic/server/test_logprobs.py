"""logprobs, top_logprobs and echo (positronic/server/logprobs.py): the model's own
log-probabilities, exact where the prompt is prefilled (held to a plain transformers forward
within 1e-4), teacher-forced through the session's cache where it is read token by token."""

import json

import httpx
import pytest
import torch

MODEL = "random:tiny"


@torch.no_grad()
def plain(lm, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward over `ids` [len, vocab]."""
    return torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_gives_every_prompt_token_its_exact_logprob_and_the_reply_its_own(live, tiny):
    prompt = "the quick brown fox jumps"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "logprobs": 3, "echo": True, "ignore_eos": True,
            "user": "echo-1"}
    answer = live.post("/v1/completions", body).json()
    choice = answer["choices"][0]
    assert choice["text"].startswith(prompt)
    ids = [tiny.bos_id] + tiny.encode(prompt)
    generated = live.server.pool.loaded["echo-1"].brain.state.live_token_ids()[len(ids):]
    reference = plain(tiny, ids + generated)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tiny.decode([t]) for t in ids[1:] + generated]
    expected = [float(reference[i - 1, t]) for i, t in enumerate(ids + generated) if i > 0]
    assert logprobs["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    for place, top in enumerate(logprobs["top_logprobs"]):
        best = torch.topk(reference[place], 3).values.tolist()
        # a map token text -> logprob (the API's shape): two ids of one text (byte pieces) share an entry
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(best[0], abs=1e-4)
        assert all(any(abs(v - b) < 1e-4 for b in best) for v in top.values())
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert answer["positronic"]["logprobs"] == "exact"


def test_token_id_prompts_are_echoed_as_sent_and_the_first_has_no_logprob(live, tiny):
    ids = [tiny.bos_id] + tiny.encode("a b c d")  # as lm-evaluation-harness sends them
    choice = live.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "logprobs": 1,
                                           "echo": True, "temperature": 0}).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    reference = plain(tiny, ids)
    assert logprobs["token_logprobs"][1:len(ids)] == pytest.approx(
        [float(reference[i - 1, t]) for i, t in enumerate(ids) if i > 0], abs=1e-4)


def test_a_prompt_past_the_budget_is_teacher_forced_and_says_so(live, tiny):
    budget = live.server.config.budget
    ids = [tiny.bos_id] + [5 + (i * 7) % 400 for i in range(budget + 20)]
    answer = live.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2, "logprobs": 0,
                                           "echo": True}).json()
    assert "teacher-forced" in answer["positronic"]["logprobs"]
    values = answer["choices"][0]["logprobs"]["token_logprobs"]
    assert len(values) == len(ids) + 2 and all(v is not None for v in values[1:])
    reference = plain(tiny, ids[:budget])  # the prefilled part is exact
    assert values[1:budget] == pytest.approx([float(reference[i - 1, ids[i]]) for i in range(1, budget)], abs=1e-4)


def test_a_long_prompt_without_echo_is_pruned_by_the_policy_not_refused(live, tiny):
    budget = live.server.config.budget
    ids = [tiny.bos_id] + [5 + (i * 3) % 400 for i in range(budget * 2)]
    answer = live.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 3, "user": "long-1"}).json()
    assert answer["usage"]["prompt_tokens"] == len(ids)
    pruned = answer["usage"]["prompt_tokens_pruned"]
    assert pruned == answer["positronic"]["pruned_prompt_tokens"] >= len(ids) - budget
    assert answer["positronic"]["live_length"] <= budget
    too_long = live.post("/v1/completions", {"model": MODEL, "prompt": [1] * (tiny.max_positions + 1)})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_chat_logprobs_stream_with_their_tokens(live, tiny):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "logprobs": True,
            "top_logprobs": 2, "stream": True, "ignore_eos": True}
    content, text = [], ""
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                content += (choice["logprobs"] or {}).get("content", [])
    assert len(content) == 5 and "".join(entry["token"] for entry in content) == text
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
        assert entry["bytes"] == list(entry["token"].encode())
    whole = live.post("/v1/chat/completions", {**body, "stream": False}).json()["choices"][0]["logprobs"]
    assert [e["token"] for e in whole["content"]] == [e["token"] for e in content]


@pytest.mark.parametrize("fields, param", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"echo": "yes"}, "echo"),
])
def test_bad_logprobs_fields_are_refused(live, fields, param):
    response = live.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_chat_top_logprobs_needs_logprobs_and_keys_refuse_logprobs(live):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    response = live.post("/v1/chat/completions", {**chat, "top_logprobs": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    keyed = live.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "logprobs": 1, "user": "k"},
                      headers={"Idempotency-Key": "a"})
    assert keyed.status_code == 400 and keyed.json()["error"]["param"] == "logprobs"
