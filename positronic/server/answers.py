"""Retries that cannot duplicate or lose a turn: the `Idempotency-Key` header.

A client whose connection broke (the server killed, restarted, a network fault) cannot know
whether its session took the request: the reply may have been checkpointed before the last
bytes were lost, or never generated. It sends the request again with the same key, and the
session answers it exactly once:

- the key is the session's last request and its reply is complete: the same answer again,
  nothing generated (`positronic.replayed` is true);
- its reply was cut (a shutdown, the client leaving): generation goes on where it stopped and
  the answer is the whole reply, as the request would have had it uninterrupted;
- the session never took it (it was lost with the process before a checkpoint): a new request.

The record (`Answers`) is checkpointed with the session in the same atomic write as its
brain (session.save's note), so a checkpoint holds a reply exactly when it holds the record
of it. A key is the session's, not the server's: one session's keys do not collide with
another's. Only the last request's answer is kept: a key among the session's recent ones but
not the last gets 409 (its answer is gone: the session has answered later requests), and a
key sent again with a different request gets 422 (the IETF Idempotency-Key draft's rule).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import deque
from dataclasses import dataclass

from .schemas import APIError, GenerationBody
from .text import Reply

HEADER = "idempotency-key"
KEY = re.compile(r"[\x20-\x7e]{1,255}")  # printable ASCII, as a header value carries it
RECENT = 64  # keys a session remembers, to refuse a stale one rather than take it as new


def check_key(value: str | None, session_id: str | None) -> str | None:
    """The request's key, checked (None: the request has none)."""
    if value is None:
        return None
    if not KEY.fullmatch(value):
        raise APIError(400, "the Idempotency-Key header must be 1 to 255 printable ASCII characters",
                       code="invalid_idempotency_key")
    if session_id is None:
        raise APIError(400, "the Idempotency-Key header needs a session (the user field or X-Session-Id): the "
                            "answer it names is kept with the session", code="invalid_idempotency_key")
    return value


def fingerprint(body: GenerationBody, chat: bool) -> str:
    """What makes two requests the same request: the endpoint and every field but how the
    answer is delivered (a stream may be retried as a whole reply, and the reverse)."""
    fields = body.model_dump(mode="json", exclude={"stream", "stream_options"})
    text = json.dumps({"chat": chat, **fields}, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Answer:
    """A keyed request's answer: the tokens its input added, and its reply (None while its
    input is still being read; a live Reply while generating)."""

    key: str
    fingerprint: str
    prompt_tokens: int
    reply: Reply | None = None

    @property
    def complete(self) -> bool:
        return self.reply is not None and self.reply.done

    def note(self) -> dict:
        reply = self.reply
        return {"key": self.key, "fingerprint": self.fingerprint, "prompt_tokens": self.prompt_tokens,
                "reply": None if reply is None else {"anchor": reply.anchor, "ids": list(reply.ids),
                                                     "tokens": reply.tokens, "text": reply.text,
                                                     "finish_reason": reply.finish_reason}}


class Answers:
    """A session's keyed answers: the last one, and the keys before it."""

    def __init__(self):
        self.last: Answer | None = None
        self.recent: deque[str] = deque(maxlen=RECENT)
        self._saved: dict | None = None  # the last answer's reply as checkpointed, until it is resumed

    def find(self, key: str, print_: str) -> Answer | None:
        """The answer `key` names, if the session took that request; None for a new key."""
        if self.last is not None and self.last.key == key:
            if self.last.fingerprint != print_:
                raise APIError(422, "this Idempotency-Key was used for a different request in this session; a retry "
                                    "must repeat its request exactly (only stream and stream_options may differ)",
                               code="idempotency_key_reused")
            return self.last
        if key in self.recent:
            raise APIError(409, "this Idempotency-Key names an earlier request whose answer is no longer kept: the "
                                "session has answered later requests since", code="idempotency_key_expired")
        return None

    def begin(self, key: str, print_: str, prompt_tokens: int) -> Answer:
        """A new keyed request, its input queued."""
        if self.last is not None:
            self.recent.append(self.last.key)
        self.last, self._saved = Answer(key, print_, prompt_tokens), None
        return self.last

    def forget(self) -> None:
        """A request without a key changed the session: the last keyed answer is no longer its
        last request's (a retry of it would generate again after the newer turn)."""
        if self.last is not None:
            self.recent.append(self.last.key)
            self.last, self._saved = None, None

    def resumed_reply(self, lm, max_tokens: int, stops: list[str], ignore_eos: bool,
                      stop_ids: set[int]) -> Reply | None:
        """The last answer's reply as a retry continues it: a checkpointed reply is rebuilt by
        taking its tokens again (the retry repeats the request: the same max_tokens, stops)."""
        answer = self.last
        if answer.reply is None and self._saved is not None:
            saved = self._saved
            reply = Reply(lm, saved["anchor"], max_tokens, stops, ignore_eos=ignore_eos, stop_ids=stop_ids)
            if saved["finish_reason"] is not None:
                reply.ids, reply.tokens = list(saved["ids"]), saved["tokens"]
                reply.text, reply.finish_reason = saved["text"], saved["finish_reason"]
            else:
                for token_id in saved["ids"]:
                    reply.add(token_id)
            answer.reply, self._saved = reply, None
        return answer.reply

    # -- the checkpoint's note --

    def note(self) -> dict:
        last = None
        if self.last is not None:
            last = self.last.note()
            if self.last.reply is None and self._saved is not None:
                last["reply"] = self._saved
        return {"answers": {"last": last, "recent": list(self.recent)}}

    @classmethod
    def from_note(cls, note: dict | None, vocab_size: int) -> Answers:
        """The answers a checkpoint kept; ValueError naming what is malformed."""
        answers = cls()
        if note is None:
            return answers  # a session saved before keyed answers, or by a run
        saved = note.get("answers")
        if saved is None:
            return answers
        if not (isinstance(saved, dict) and set(saved) == {"last", "recent"}):
            raise ValueError("the session's answer record is malformed")
        recent = saved["recent"]
        if not (isinstance(recent, list) and len(recent) <= RECENT
                and all(isinstance(k, str) and KEY.fullmatch(k) for k in recent)):
            raise ValueError("the session's recent idempotency keys are malformed")
        answers.recent.extend(recent)
        last = saved["last"]
        if last is None:
            return answers
        if not (isinstance(last, dict) and set(last) == {"key", "fingerprint", "prompt_tokens", "reply"}
                and isinstance(last["key"], str) and KEY.fullmatch(last["key"])
                and isinstance(last["fingerprint"], str) and re.fullmatch(r"[0-9a-f]{64}", last["fingerprint"])
                and type(last["prompt_tokens"]) is int and last["prompt_tokens"] >= 0):
            raise ValueError("the session's last answer is malformed")
        reply = last["reply"]
        if reply is not None and not (
                isinstance(reply, dict) and set(reply) == {"anchor", "ids", "tokens", "text", "finish_reason"}
                and type(reply["anchor"]) is int and 0 <= reply["anchor"] < vocab_size
                and isinstance(reply["ids"], list) and all(type(t) is int and 0 <= t < vocab_size for t in reply["ids"])
                and type(reply["tokens"]) is int and len(reply["ids"]) <= reply["tokens"] <= len(reply["ids"]) + 1
                and isinstance(reply["text"], str) and reply["finish_reason"] in (None, "stop", "length")):
            raise ValueError("the session's last reply is malformed")
        answers.last = Answer(last["key"], last["fingerprint"], last["prompt_tokens"])
        answers._saved = reply
        return answers
