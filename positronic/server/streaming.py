"""Answers on the wire: OpenAI's objects, whole (one JSON body) or as server-sent events
(`data: {chunk}` per piece of text, then `data: [DONE]`).

A writer per endpoint shapes the answer (`whole`, or `opening`/`piece`/`closing`/`usage`
chunks); `EventStream` sends the chunks and closes their iterator however the response ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

import anyio
from fastapi.responses import StreamingResponse

log = logging.getLogger("positronic.server.app")


def sse(data: dict | str) -> str:
    """One server-sent event in the OpenAI wire format."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


async def as_events(payloads):
    """Payloads (answer chunks, error bodies, the closing "[DONE]") -> server-sent events.
    Closing this closes `payloads`, so a reply lets go of its conversation as soon as its
    stream ends, however it ends."""
    async with contextlib.aclosing(payloads):
        async for payload in payloads:
            yield sse(payload)


class EventStream(StreamingResponse):
    """Server-sent events whose iterator is closed however the response ends (a client that
    went away included), so the request lets go of its conversation at once."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs when its graceful shutdown times out (a client that
            # leaves is not this: Starlette ends that stream itself): the stream is cut, and
            # the server's close() does not checkpoint its session. No traceback for it.
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
            log.warning("a stream was cancelled by the shutdown before its reply was finished")
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


class CompletionWriter:
    """/v1/completions answers: `text_completion` objects, whole or in chunks."""

    def __init__(self, model: str):
        self.model, self.id, self.created = model, f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def _object(self, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def whole(self, text: str, finish_reason: str, usage: dict, logprobs: dict | None = None) -> dict:
        return {**self._object(text, finish_reason, logprobs), "usage": usage}

    def opening(self) -> dict | None:
        return None

    def piece(self, text: str, logprobs: dict | None = None) -> dict:
        return self._object(text, None, logprobs)

    def closing(self, finish_reason: str, logprobs: dict | None = None) -> dict:
        return self._object("", finish_reason, logprobs)

    def usage(self, usage: dict) -> dict:
        return {**self._object("", None), "choices": [], "usage": usage}


class ChatWriter:
    """/v1/chat/completions answers: `chat.completion`, or `chat.completion.chunk`s."""

    def __init__(self, model: str):
        self.model, self.id, self.created = model, f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def _chunk(self, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def whole(self, text: str, finish_reason: str, usage: dict, logprobs: dict | None = None,
              tool_calls: list[dict] | None = None) -> dict:
        """`tool_calls`: the reply calls tools (`text` is its content before them, null when empty)."""
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message, finish_reason = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}, "tool_calls"
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                             "finish_reason": finish_reason}], "usage": usage}

    def opening(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def piece(self, text: str, logprobs: dict | None = None) -> dict:
        return self._chunk({"content": text}, None, logprobs)

    def closing(self, finish_reason: str, logprobs: dict | None = None) -> dict:
        return self._chunk({}, finish_reason, logprobs)

    def calls(self, content: str, tool_calls: list[dict], logprobs: dict | None = None) -> dict:
        """The chunk of a reply's tool calls, whole (a client adds up `delta.tool_calls` by index)."""
        delta = {"content": content or None,
                 "tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]}
        return self._chunk(delta, None, logprobs)

    def usage(self, usage: dict) -> dict:
        return {**self._chunk({}, None), "choices": [], "usage": usage}

