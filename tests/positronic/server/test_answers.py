"""A retried request (the Idempotency-Key header) is answered exactly once per session, and
each answer is written through to the session's checkpoint before its last byte
(positronic/server/answers.py). The module's server (`live`) has room to spare and is the
uninterrupted reference."""

import json
import shutil

import httpx
import pytest

from positronic.brain import session as sessions

MODEL = "random:tiny"
BODY = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 24, "ignore_eos": True}


def keyed(server, session: str, key: str, body=BODY, **changes) -> httpx.Response:
    return server.post("/v1/completions", {**body, "user": session, **changes}, headers={"Idempotency-Key": key})


def streamed(server, session: str, key: str, body=BODY, chunks: int | None = None) -> tuple[str, list[dict]]:
    """A keyed stream's text and its events; after `chunks` pieces the client hangs up."""
    text, events = "", []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "user": session, "stream": True},
                      headers={"Idempotency-Key": key}, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            events.append(event)
            text += event["choices"][0]["text"] if event.get("choices") else ""
            if chunks is not None and len(events) >= chunks:
                break  # the connection closes with the block: the client went away mid-reply
    return text, events


def saved_reply(directory, session: str) -> str:
    """The last keyed reply a session's checkpoint holds."""
    _, meta = sessions.load(directory / session)
    return meta["note"]["answers"]["last"]["reply"]["text"]


@pytest.fixture(scope="module")
def reference(live):
    """The text of BODY, then of a second prompt, in uninterrupted sessions: "reference-1"
    took BODY, "reference" took both."""
    live.post("/v1/completions", {**BODY, "user": "reference-1"})
    first = live.post("/v1/completions", {**BODY, "user": "reference"}).json()["choices"][0]["text"]
    second = live.post("/v1/completions", {**BODY, "prompt": " and then", "user": "reference"}).json()
    return first, second["choices"][0]["text"]


def transcript(server, session: str) -> dict:
    state = server.get(f"/v1/sessions/{session}").json()
    return {name: state[name] for name in ("transcript", "transcript_tokens", "tick")}


def test_a_retried_request_gets_the_same_answer_and_nothing_is_generated_again(live, reference):
    first = keyed(live, "r1", "k-1")
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == reference[0]
    assert first.json()["positronic"]["checkpointed"] is True and "retried" not in first.json()["positronic"]
    before = live.get("/v1/sessions/r1").json()
    again = keyed(live, "r1", "k-1")
    assert again.status_code == 200
    assert again.json()["choices"] == first.json()["choices"] and again.json()["usage"] == first.json()["usage"]
    assert again.json()["positronic"]["retried"] == "replayed"
    after = live.get("/v1/sessions/r1").json()
    assert (after["tick"], after["transcript"]) == (before["tick"], before["transcript"])
    text, events = streamed(live, "r1", "k-1")  # the same answer as a stream
    assert text == reference[0] and events[-1]["choices"][0]["finish_reason"] == "length"
    second = keyed(live, "r1", "k-2", prompt=" and then")  # a new key is a new request
    assert second.json()["choices"][0]["text"] == reference[1]


def test_a_key_sent_with_another_request_or_after_a_later_one_is_refused(live):
    assert keyed(live, "r2", "k-a").status_code == 200
    reused = keyed(live, "r2", "k-a", max_tokens=5)
    assert reused.status_code == 422 and reused.json()["error"]["code"] == "idempotency_key_reused"
    assert keyed(live, "r2", "k-b", prompt=" more").status_code == 200
    stale = keyed(live, "r2", "k-a")
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "idempotency_key_expired"
    other_session = keyed(live, "r2-other", "k-a")  # keys belong to their session
    assert other_session.status_code == 200 and "retried" not in other_session.json()["positronic"]


@pytest.mark.parametrize("headers, body, code", [
    ({"Idempotency-Key": "k"}, {}, "invalid_idempotency_key"),  # no session to keep the answer
    ({"Idempotency-Key": "x" * 256}, {"user": "r3"}, "invalid_idempotency_key"),
    ({"Idempotency-Key": "tab\there"}, {"user": "r3"}, "invalid_idempotency_key"),
])
def test_a_malformed_key_or_one_without_a_session_is_refused(live, headers, body, code):
    response = live.post("/v1/completions", {**BODY, **body}, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["code"] == code
    assert live.get("/v1/sessions/r3").status_code == 404  # nothing was taken


def test_a_reply_cut_by_a_client_that_left_is_continued_by_its_retry(live):
    long = {**BODY, "max_tokens": 800}  # long enough that the server notices the client leaving
    whole = live.post("/v1/completions", {**long, "user": "reference-long"}).json()["choices"][0]["text"]
    cut, _ = streamed(live, "r4", "k-cut", body=long, chunks=4)
    assert whole.startswith(cut) and len(cut) < len(whole)
    assert live.get("/v1/sessions/r4").json()["tick"] < live.get("/v1/sessions/reference-long").json()["tick"]
    text, events = streamed(live, "r4", "k-cut", body=long)
    assert text == whole  # the whole reply, as if never interrupted
    assert events[-1]["positronic"]["retried"] == "continued"
    assert transcript(live, "r4") == transcript(live, "reference-long")


def test_a_checkpoint_before_or_after_the_reply_both_answer_a_retry_exactly(
        tiny, tmp_path, live, live_server, server_settings, reference):
    """A kill loses what the process held: the disk has the checkpoint from before the request
    (the retry generates it) or the one written before the answer's last byte (the retry
    replays it). Both are simulated by copying the session directory and serving the copy."""
    settings = server_settings(tmp_path / "first")
    with live_server(tiny, settings) as server:
        assert keyed(server, "k", "k-1").status_code == 200
        shutil.copytree(settings.session_dir, tmp_path / "before")
        answered = keyed(server, "k", "k-2", prompt=" and then")
        assert answered.json()["choices"][0]["text"] == reference[1]
        assert saved_reply(settings.session_dir, "k") == reference[1]  # on disk before the answer came back
        shutil.copytree(settings.session_dir, tmp_path / "after")
    for copy, how in (("before", None), ("after", "replayed")):
        copied = server_settings(tmp_path / copy)
        copied.session_dir = tmp_path / copy
        with live_server(tiny, copied) as server:
            again = keyed(server, "k", "k-2", prompt=" and then")
            assert again.json()["choices"][0]["text"] == reference[1], copy
            assert again.json()["positronic"].get("retried") == how, copy
            assert transcript(server, "k") == transcript(live, "reference")


def test_a_damaged_answer_record_makes_the_session_unusable_not_silently_new(
        tiny, tmp_path, live_server, server_settings):
    from positronic import mirror

    settings = server_settings(tmp_path)
    with live_server(tiny, settings) as server:
        assert keyed(server, "d", "k-1").status_code == 200
    path = settings.session_dir / "d" / sessions.MIRROR_FILE
    saved, meta = mirror.load(path)
    meta["note"]["answers"]["last"]["reply"]["ids"] = [10**9]  # outside the vocabulary
    mirror.save(path, saved, meta)
    with live_server(tiny, settings) as server:
        refused = keyed(server, "d", "k-1")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_unusable"
        assert "last reply is malformed" in refused.json()["error"]["message"]
