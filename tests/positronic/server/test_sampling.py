"""Every sampling field a request sends is honoured (through steps/sample.py, the run's own
sampler: transformers' logits processors) or refused with 400 naming it; nothing is silently
ignored. The module's server (`live`) is greedy by default (temperature 0)."""

import itertools

import pytest

MODEL = "random:tiny"
COUNTER = itertools.count()


def complete(live, **fields) -> dict:
    body = {"model": MODEL, "prompt": "the cat sat", "max_tokens": 12, "ignore_eos": True, **fields}
    response = live.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def ids(live, **fields) -> list[int]:
    """The generated token ids, read from the session's brain in the (in-process) server."""
    session = f"ids-{next(COUNTER)}"
    answer = complete(live, user=session, **fields)
    live_ids = live.server.pool.loaded[session].brain.state.live_token_ids()
    return live_ids[len(live_ids) - answer["usage"]["completion_tokens"]:]


def text(live, **fields) -> str:
    return complete(live, **fields)["choices"][0]["text"]


def test_top_k_1_and_min_p_1_are_greedy_whatever_the_temperature(live):
    greedy = text(live, temperature=0)
    assert text(live, temperature=1.5, top_k=1, seed=3) == greedy
    assert text(live, temperature=1.5, min_p=1.0, seed=3) == greedy
    assert text(live, temperature=1.5, seed=3) != greedy  # so the two above were not greedy by chance


def test_top_k_minus_1_is_off_as_in_vllm(live):
    assert text(live, temperature=1.5, top_k=-1, seed=4) == text(live, temperature=1.5, top_k=0, seed=4)


FAVOURED = 300  # a token id of random:tiny's vocabulary


def test_logit_bias_bans_and_forces_tokens(live):
    assert ids(live, logit_bias={str(FAVOURED): 100}) == [FAVOURED] * 12
    first = ids(live)[0]
    assert ids(live, logit_bias={str(first): -100})[0] != first


def test_stop_token_ids_end_the_reply_out_of_its_text(live):
    answer = complete(live, logit_bias={str(FAVOURED): 100}, stop_token_ids=[FAVOURED])
    choice = answer["choices"][0]
    assert (choice["text"], choice["finish_reason"], answer["usage"]["completion_tokens"]) == ("", "stop", 1)


def test_penalties_change_what_is_drawn(live):
    repeated = {"logit_bias": {str(FAVOURED): 2}}  # favoured, not forced: penalties can overcome it
    plain = ids(live, **repeated).count(FAVOURED)
    assert plain >= 6
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 100.0}):
        assert ids(live, **repeated, **penalty).count(FAVOURED) < plain, penalty


@pytest.mark.parametrize("fields, param", [
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"best_of_n_made_up": 3}, "best_of_n_made_up"),
    ({"suffix": "and so on"}, "suffix"),
])
def test_a_field_out_of_range_or_not_implemented_is_refused_by_name(live, fields, param):
    response = live.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("fields", [
    {"store": True}, {"metadata": {"a": "b"}}, {"made_up": None}, {"tools": []}, {"suffix": ""},
    {"response_format": {"type": "text"}},
])
def test_fields_that_change_nothing_are_accepted(live, fields):
    response = live.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields})
    assert response.status_code == 200, response.text


def test_a_run_and_the_server_sample_the_same_way(live, tiny):
    """The same settings through `run`'s Brain and through a request: the same tokens."""
    from positronic.brain.loop import Brain, BrainConfig

    fields = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                  repetition_penalty=1.2)
    served = complete(live, seed=11, **fields)["choices"][0]["text"]
    prompt = [tiny.bos_id] + tiny.encode("the cat sat")
    brain = Brain.start(tiny, prompt, BrainConfig(**{**vars(live.server.config), **fields, "seed": 11}))
    tokens = [brain.step().token_id for _ in range(12)]
    assert tiny.decode(prompt[-1:] + tokens)[len(tiny.decode(prompt[-1:])):] == served
