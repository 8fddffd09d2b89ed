"""A chat request's earlier messages are checked against its session's history
(positronic/server/history.py): the history as the session answered it (or its last
messages, or none) goes on; an edited or regenerated message is refused with 409, or, with
history_edits="rebuild", starts the session again from the request's messages."""

import json
import threading
import time

import httpx

from positronic.server.conversation import Conversation
from positronic.server.history import History
from positronic.server.turn import Turn

MODEL = "random:tiny"


def ask(server, session, messages, max_tokens=6):
    return server.post("/v1/chat/completions", {"model": MODEL, "user": session, "messages": messages,
                                                "max_tokens": max_tokens, "ignore_eos": True})


def talk(server, session, texts) -> list[dict]:
    """The messages of a session that said each of `texts` in turn, sending its whole history."""
    history = []
    for text in texts:
        history.append({"role": "user", "content": text})
        answer = ask(server, session, history)
        assert answer.status_code == 200, answer.text
        history.append({"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]})
    return history


def test_the_history_as_answered_its_last_messages_or_none_go_on(live):
    history = talk(live, "h1", ["one", "two"])
    assert ask(live, "h1", history + [{"role": "user", "content": "three"}]).status_code == 200
    assert ask(live, "h1", [{"role": "user", "content": "four"}]).status_code == 200  # only the new message
    assert ask(live, "h1", history[2:] + [{"role": "user", "content": "five"}]).status_code == 409  # "three" is missing


def test_an_edited_or_regenerated_message_is_refused_and_the_session_is_untouched(live):
    history = talk(live, "h2", ["alpha", "beta"])
    before = live.get("/v1/sessions/h2").json()
    edited = [dict(m) for m in history]
    edited[0]["content"] = "ALPHA"
    regenerated = [dict(m) for m in history]
    regenerated[3]["content"] += " (again)"
    for messages, at in ((edited, 0), (regenerated, 3)):
        refused = ask(live, "h2", messages + [{"role": "user", "content": "gamma"}])
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("history_mismatch", f"messages.{at}")
    assert live.get("/v1/sessions/h2").json() == before


def test_with_rebuild_an_edited_history_starts_the_session_again(tiny, tmp_path, live_server, server_settings):
    with live_server(tiny, server_settings(tmp_path, history_edits="rebuild")) as server:
        history = talk(server, "h3", ["first", "second"])
        edited = [dict(m) for m in history] + [{"role": "user", "content": "third"}]
        edited[2]["content"] = "SECOND"
        rebuilt = ask(server, "h3", edited)
        fresh = ask(server, "h3-fresh", edited)  # a new session given the same messages
        assert rebuilt.status_code == fresh.status_code == 200
        assert rebuilt.json()["choices"] == fresh.json()["choices"]
        said = [server.get(f"/v1/sessions/{s}").json() for s in ("h3", "h3-fresh")]
        assert said[0]["transcript"] == said[1]["transcript"] and said[0]["tick"] == said[1]["tick"]


def test_the_history_is_checkpointed_with_the_session(tiny, tmp_path, live_server, server_settings):
    settings = server_settings(tmp_path)
    with live_server(tiny, settings) as server:
        history = talk(server, "h4", ["kept"])
    with live_server(tiny, settings) as server:  # resumed from its checkpoint
        edited = [{"role": "user", "content": "changed"}, history[1], {"role": "user", "content": "next"}]
        assert ask(server, "h4", edited).status_code == 409
        assert ask(server, "h4", history + [{"role": "user", "content": "next"}]).status_code == 200


def test_a_reply_whose_last_tick_outlived_its_client_is_recorded_whole_and_kept(
        tiny, tmp_path, live_server, server_settings, monkeypatch):
    """The kill soak's 409: a client leaves a stream while the reply's last tick runs. The tick
    still ends the reply (its answer holds it whole), so the history must record the whole
    reply too, not the text as it stood when the client left; the retry replays the answer
    (nothing generated), and after a restart from the checkpoints the session still agrees
    with the client that sends its history back."""
    last_tick, original = threading.Event(), Turn._next_token

    def slow_last(turn, tick):
        if turn.reply is not None and len(turn.reply.ids) == turn.max_tokens - 1:
            last_tick.set()
            time.sleep(0.5)  # the client leaves meanwhile
        return original(turn, tick)

    monkeypatch.setattr(Turn, "_next_token", slow_last)
    settings = server_settings(tmp_path)
    said = [{"role": "user", "content": "one"}]
    body = {"model": MODEL, "user": "h5", "messages": said, "max_tokens": 6, "ignore_eos": True}
    key = {"Idempotency-Key": "h5-1"}
    with live_server(tiny, settings) as server:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, headers=key,
                          timeout=30) as response:
            assert response.status_code == 200
            assert last_tick.wait(10)
        # the connection is closed: the client left during the last tick
        again = server.post("/v1/chat/completions", body, headers=key)
        assert again.json()["positronic"]["retried"] == "replayed"
        reply = again.json()["choices"][0]["message"]["content"]
        assert server.metric("positronic_generated_tokens_total") == 6, "the last tick's token is counted too"
    assert len(reply) > 1
    with live_server(tiny, settings) as server:  # resumed from its checkpoint
        answered = ask(server, "h5", said + [{"role": "assistant", "content": reply}, {"role": "user", "content": "two"}])
        assert answered.status_code == 200, answered.text


def test_a_retry_that_mends_the_record_is_a_change_to_checkpoint(tiny):
    """A replayed answer generates nothing, yet the record it mends must reach the checkpoint:
    the conversation is dirty exactly when the record changed."""
    conversation = Conversation("s")
    conversation.history = History([("user", "one"), ("assistant", "a cut rep")])
    conversation.replied("a cut rep", again=True)
    assert not conversation.dirty
    conversation.replied("a cut reply", again=True)
    assert conversation.dirty and conversation.history.messages[-1] == ("assistant", "a cut reply")


def test_a_stream_the_shutdown_cut_is_in_the_history_as_the_client_got_it(tiny, tmp_path, live_server,
                                                                          server_settings, monkeypatch):
    """The shutdown cuts a stream at its next token and sends what the reply was holding back
    (here an incomplete character): the client has the reply as sent, so the history must hold
    the same, and the client's next chat (without a key) goes on."""
    from positronic.server.service import BrainServer

    cut, original = {"now": False, "held": ""}, Turn._next_token

    def watched(turn, tick):
        record, piece = original(turn, tick)
        reply = turn.reply
        held = reply._decode()[reply._decoded:]
        if len(reply.ids) >= 2 and held and not reply.done and not cut["now"]:
            cut.update(now=True, held=held)  # cut at the next token, with this held back
        return record, piece

    monkeypatch.setattr(Turn, "_next_token", watched)
    monkeypatch.setattr(BrainServer, "is_stopping", lambda self: cut["now"])
    said = [{"role": "user", "content": "one"}]
    body = {"model": MODEL, "user": "h6", "messages": said, "max_tokens": 40, "ignore_eos": True, "stream": True}
    text, error = "", None
    with live_server(tiny, server_settings(tmp_path)) as server:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[len("data: "):])
                    error = event.get("error") or error
                    text += "".join(c.get("delta", {}).get("content") or "" for c in event.get("choices", []))
        assert cut["now"] and error["code"] == "server_shutting_down", (cut, error)
        assert text.endswith(cut["held"])
        cut["now"] = False
        answered = ask(server, "h6", said + [{"role": "assistant", "content": text}, {"role": "user", "content": "two"}])
        assert answered.status_code == 200, answered.text
