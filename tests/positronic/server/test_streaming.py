"""Answers as server-sent events (positronic/server/streaming.py), through a real server: the
same text as the whole answer, in OpenAI's chunks, ending with `data: [DONE]`.

The server (LiveServer) and the request helpers are fixtures in tests/positronic/conftest.py.
"""

import json

import httpx

MODEL = "random:tiny"


def test_streaming_gives_the_same_text_in_openai_chunks(live, chat):
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
