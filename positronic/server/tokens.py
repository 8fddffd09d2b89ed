"""The tokenizer endpoints, `POST /tokenize` and `POST /detokenize`, as vLLM and llama-server
name them: a client counts a prompt's tokens against the context budget before it sends it.

    /tokenize    {"prompt": text} (llama-server: "content"), or {"messages": [...]}
                 -> {"tokens": [ids], "count": n, "max_model_len": the budget}
    /detokenize  {"tokens": [ids]} -> {"prompt": text, "content": text}

A prompt's ids are those a fresh session prefills: BOS then the text's ids (add_special_tokens
false: without the BOS); messages are the whole chat in the model's chat template, as a fresh
chat session prefills it (ChatFormat.conversation). Neither touches a session or the model;
both run in the server's text thread (BrainServer.off_loop), never on the event loop. A field
neither takes is refused (400 naming it) unless it is empty.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from .prepare import prompt_messages
from .rules import check_model
from .schemas import APIError, Message, message_text, refuse_unknown

# Other servers' tokenize fields that change the answer: taken only at the value this server acts
# on (None: only absent or empty), so a client never gets ids it did not ask for.
FIXED = {"add_generation_prompt": True, "continue_final_message": False, "with_pieces": False,
         "return_token_strs": False, "chat_template": None, "chat_template_kwargs": None, "tools": None}


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    content: StrictStr | None = None  # llama-server's name for the prompt
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool | None = None
    add_special: StrictBool | None = None  # llama-server's name for add_special_tokens


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    tokens: list[StrictInt]


def tokenize(server, body: TokenizeBody) -> dict:
    """The ids a fresh session would prefill for the body's prompt or messages (`server`: the
    app's BrainServer, read only: its model, chat format and budget). It tokenizes: the app
    calls it in the server's text thread (BrainServer.off_loop)."""
    lm = server.lm
    check_model(body.model, server.names)
    given = [name for name in ("prompt", "content", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise APIError(400, "a tokenize request takes one of prompt, content (the same) and messages, "
                            f"got {' and '.join(given) or 'none'}", param=given[1] if given else "prompt",
                       code="invalid_value")
    check_fixed(body)
    refuse_unknown(body, ignored=tuple(FIXED))
    bos = wants_bos(body)
    if body.messages is not None:
        texts = [message_text(message, i) for i, message in enumerate(body.messages)]
        ids = server.format.conversation(prompt_messages([(m.role, t) for m, t in zip(body.messages, texts)], None))
        if not bos and ids[:1] == [lm.bos_id]:
            ids = ids[1:]
    else:
        ids = ([lm.bos_id] if bos else []) + lm.encode(body.prompt if body.prompt is not None else body.content)
    return {"tokens": ids, "count": len(ids), "max_model_len": server.config.budget}


def check_fixed(body: TokenizeBody) -> None:
    """400 for a FIXED field asking for what this server does not do."""
    for name, fixed in FIXED.items():
        value = (body.model_extra or {}).get(name)
        if value is None or value is fixed or (fixed is None and value in ("", [], {})):
            continue
        only = f" (only {str(fixed).lower()})" if fixed is not None else ""
        raise APIError(400, f"{name} is not supported by this server{only}", param=name, code="unsupported")


def wants_bos(body: TokenizeBody) -> bool:
    """add_special_tokens, or llama-server's add_special; true when neither is given."""
    ours, theirs = body.add_special_tokens, body.add_special
    if ours is not None and theirs is not None and ours != theirs:
        raise APIError(400, "add_special_tokens and add_special (the same setting) disagree", param="add_special",
                       code="invalid_value")
    return next((value for value in (ours, theirs) if value is not None), True)


def detokenize(server, body: DetokenizeBody) -> dict:
    """The text of the body's ids, special tokens included, under vLLM's name and llama-server's."""
    lm = server.lm
    check_model(body.model, server.names)
    refuse_unknown(body)
    for i, token in enumerate(body.tokens):
        if not 0 <= token < lm.vocab_size:
            raise APIError(400, f"tokens.{i}: token ids must be in 0..{lm.vocab_size - 1}, got {token}",
                           param=f"tokens.{i}", code="invalid_value")
    text = lm.decode(body.tokens)
    return {"prompt": text, "content": text}
