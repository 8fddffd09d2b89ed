"""Answers: a generation request's reply, built as OpenAI's objects, whole or streamed.

    begun = Begun(...)                                      # what answering needs (BrainServer._begin)
    return await replies.whole(server, request, begun, chat)       # one JSON body
    return replies.streamed(server, begun, body, chat)             # server-sent events

Both run the request's Turn (turn.py) on the event loop, taking its pieces as the model
worker's job hands them over, and shape them with the endpoint's writer (streaming.py): the
text, the finish reason, `usage`, the log-probabilities (logprobs.py) and the `positronic`
extension. Before the answer's last byte the request is done with its session
(`BrainServer.checkpoint`: its keyed answer and history record the reply, the session is written
through to disk), and then lets go of its place and its conversation (`Begun.held`). `server`
is the app's BrainServer (service.py), as tokens.py takes it: its model, metrics, checkpoint and
shutdown state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from . import answers
from .conversation import Conversation
from .logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from .schemas import APIError, GenerationBody
from .streaming import ChatWriter, CompletionWriter, EventStream, as_events
from .tools import CallScanner
from .turn import ClientGone, ServerStopping, Turn

log = logging.getLogger("positronic.server.app")


@dataclass
class Begun:
    """A request admitted, its conversation held and its input queued: what answering it needs."""

    held: contextlib.AsyncExitStack  # its place and its conversation, let go when the answer ends
    conversation: Conversation
    turn: Turn
    answer: answers.Answer | None  # its Idempotency-Key's record
    writer: ChatWriter | CompletionWriter
    headers: dict | None
    echoed: str | None  # the prompt's text, when it is echoed


def extension(conversation: Conversation, turn: Turn) -> dict:
    """The session's state after the request (a field OpenAI clients ignore): its counts,
    whether its checkpoint holds this reply, for a retried request (Idempotency-Key)
    whether the reply was replayed (nothing generated) or a cut one continued, prompt tokens
    the policy pruned at once, and how echoed log-probabilities were computed."""
    brain = conversation.brain
    state = {"session": conversation.id, "tick": brain.tick, "live_length": brain.state.rows_per_layer,
             "budget": brain.config.budget, "ledger_tokens": len(brain.state.mirror.ledger),
             "checkpointed": conversation.id is not None and not conversation.dirty}
    if turn.retried:
        state["retried"] = "replayed" if turn.generated == 0 else "continued"
    if turn.prepared.pruned:
        state["pruned_prompt_tokens"] = turn.prepared.pruned
    if turn.echo and turn.logprobs is not None:
        state["logprobs"] = turn.prepared.how
    return state


def usage(turn: Turn) -> dict:
    prompt_tokens, generated = turn.prepared.tokens, turn.reply.tokens if turn.reply else 0
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}
    if turn.prepared.pruned:  # the policy pruned a prompt past the budget (also in the positronic field)
        usage["prompt_tokens_pruned"] = turn.prepared.pruned
    return usage


def echo_text(lm, prompt) -> str:
    """The prompt as echo returns it: its text (token ids decoded)."""
    prompt = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else prompt
    return prompt if isinstance(prompt, str) else lm.decode(list(prompt))


def logprobs_of(lm, chat: bool, entries: list[TokenLogprob], offset: int = 0) -> dict:
    return chat_logprobs(lm, entries) if chat else completion_logprobs(lm, entries, offset)


def shutting_down(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="server_shutting_down")


async def whole(server, request: Request, begun: Begun, chat: bool) -> Response:
    """The whole reply as one JSON body (499 when the client left before it was done)."""
    answer = await reply(server, request, begun, chat)
    if answer is None:
        return Response(status_code=499)  # nobody reads it
    return JSONResponse(answer, headers=begun.headers)


async def reply(server, request: Request, begun: Begun, chat: bool) -> dict | None:
    """The whole reply, the answer object (the turn runs here); None when the client left."""
    conversation, turn, echoed = begun.conversation, begun.turn, begun.echoed
    async with begun.held:
        try:
            async with contextlib.aclosing(turn.pieces(gone=request.is_disconnected)) as pieces:
                async for _ in pieces:
                    pass
        except ClientGone:
            return None
        except asyncio.CancelledError:  # only uvicorn's shutdown cancels a whole reply (a client that
            conversation.cut = True     # leaves is polled): marked before the session is let go
            raise
        finally:
            await server.checkpoint(conversation, begun.answer, turn)
            server.metrics.record_reply(0 if turn.retried else turn.prepared.tokens, turn.generated,
                                            turn.reply.finish_reason if turn.reply else None)
        entries = (turn.prepared.echoed + turn.read if echoed is not None else []) + turn.entries
        logprobs = logprobs_of(server.lm, chat, entries) if turn.logprobs is not None else None
        text = (echoed or "") + turn.reply.text
        if (made := turn.tool_calls()) is not None:
            answer = begun.writer.whole(made[0], turn.reply.finish_reason, usage(turn), logprobs, tool_calls=made[1])
        else:
            answer = begun.writer.whole(text, turn.reply.finish_reason, usage(turn), logprobs)
        answer["positronic"] = extension(conversation, turn)
    return answer


def streamed(server, begun: Begun, body: GenerationBody, chat: bool) -> EventStream:
    """The reply as server-sent events (`events` on the wire)."""
    return EventStream(as_events(events(server, begun, body, chat)), headers=begun.headers)


async def events(server, begun: Begun, body: GenerationBody, chat: bool):
    """The reply's server-sent events, as payloads (`as_events` puts them on the wire): the
    opening chunk, a chunk per piece of text, the
    closing chunk (finish reason, and the session's state: checkpointed by then), the usage
    chunk if the body's stream_options ask, `data: [DONE]`. An error after the first byte becomes
    an error event; so does the shutdown, at the next token, once every token generated has been
    sent (the session keeps just those, and a retry with its Idempotency-Key continues the reply).
    With echo the prompt comes first, in a chunk of its own; with logprobs each chunk
    carries its tokens' (a token whose text was held back rides with the next chunk). A reply
    that may call tools streams its text until a call may begin (tools.CallScanner); from there
    it is held and sent at the end as one chunk: its calls (`delta.tool_calls`, finish_reason
    "tool_calls"), or the rest of its text."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    held, conversation, turn, answer, writer, echoed = (begun.held, begun.conversation, begun.turn, begun.answer,
                                                        begun.writer, begun.echoed)
    listed = turn.logprobs is not None
    sent, offset = 0, 0  # entries sent; characters sent (a completion's text_offset)

    def logprobs(entries: list[TokenLogprob]) -> dict | None:
        return logprobs_of(server.lm, chat, entries, offset) if listed else None

    rest = ""  # what a reply the shutdown cut was holding back: sent before the error event
    calls = CallScanner() if turn.tools is not None else None  # holds what may be a tool call
    try:
        async with held:
            checkpointed = False
            try:
                if (opening := writer.opening()) is not None:
                    yield opening
                # closed as soon as this stream is (a client that left): its job stops before its next tick
                async with contextlib.aclosing(turn.pieces(stop=server.is_stopping)) as pieces:
                    async for piece in pieces:
                        if echoed is not None:  # the prompt was read by now (its logprobs too)
                            yield writer.piece(echoed, logprobs(turn.prepared.echoed + turn.read))
                            offset, echoed = len(echoed), None
                        if calls is not None and not (piece := calls.push(piece)):
                            continue
                        new, sent = turn.entries[sent : turn.ready], turn.ready
                        yield writer.piece(piece, logprobs(new))
                        offset += len(piece)
                if echoed is not None:
                    yield writer.piece(echoed, logprobs(turn.prepared.echoed + turn.read))
                finish = turn.reply.finish_reason
                if calls is not None:
                    new, sent = turn.entries[sent:], len(turn.entries)
                    if (made := turn.tool_calls()) is not None:  # its content before them was sent
                        yield writer.calls(made[0][len(calls.sent.strip()):].strip(), made[1], logprobs(new))
                        finish = "tool_calls"
                    elif (rest := calls.flush()) or new:
                        yield writer.piece(rest, logprobs(new))
                await server.checkpoint(conversation, answer, turn)
                checkpointed = True
                closing = writer.closing(finish, logprobs(turn.entries[sent:]) if sent < len(turn.entries) else None)
                closing["positronic"] = extension(conversation, turn)
                yield closing
                if include_usage:
                    yield writer.usage(usage(turn))
            except ServerStopping:
                if turn.reply is not None:  # cut before the checkpoint: it records the reply as sent
                    rest = (calls.flush() if calls is not None else "") + turn.reply.cut()
                raise
            except asyncio.CancelledError:
                if server.stopping:  # uvicorn's shutdown timed out on this stream (not a client leaving)
                    conversation.cut = True
                raise
            finally:
                if not checkpointed:  # (it waits for a tick left running: its token is counted too)
                    await server.checkpoint(conversation, answer, turn)
                server.metrics.record_reply(0 if turn.retried else turn.prepared.tokens, turn.generated,
                                            turn.reply.finish_reason if turn.reply else None)
    except ServerStopping:
        if rest:
            yield writer.piece(rest)
        generated = turn.reply.tokens if turn.reply else 0
        yield shutting_down(f"the server is shutting down: the reply was cut after {generated} tokens "
                            "(all sent; the session keeps them)").body()
    except Exception as exc:
        log.exception("a streamed request failed")
        yield APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error").body()
    yield "[DONE]"
