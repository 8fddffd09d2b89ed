"""Request rules: what a generation request may ask, beyond the schemas (schemas.py).

The checks here need what a pydantic model does not have: the model served (its name, its
vocabulary, its positions), the server's limits (ServerSettings), the request's headers, or its
session (how full it is). Each refuses with an `APIError` naming the field (`param`), OpenAI's
error shape. They are plain functions of what they read, and run on the event loop: none
tokenizes (a text's length is bounded with `lm.fewest_tokens`, without encoding) and none
touches a brain.

    rules.check(body, lm, settings)                   # the model, n, best_of, unknown fields
    rules.max_tokens_of(body, chat, settings)         # the reply's length bound
    rules.session_id(request, body.user)              # the session the request names, or None
    rules.sampling(body, lm.vocab_size)               # its sampling fields as BrainConfig settings
    rules.constraint_of(body, lm)                     # the grammar its reply keeps to (off the event loop)
    rules.prompt_limit(lm, config)                    # the most tokens a fresh brain may take
    rules.check_room(conversation, adding, "prompt")  # a session that evicts nothing: does it fit?
"""

from __future__ import annotations

import re

from fastapi import Request

from ..brain.config import logit_bias_text
from ..brain.grammar import Grammar, GrammarError, is_lark
from ..brain.loop import BrainConfig
from . import answers
from .conversation import Conversation, evicts_nothing
from .schemas import ACTED_ON, IGNORED, APIError, ChatBody, GenerationBody, Message, message_text, refuse_unknown

SESSION_HEADER = "x-session-id"
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
PROMPT_WHY = "a running session's prompt may add (the budget less the protected rows)"


def check_session_id(value: str) -> str:
    """`value` if it is a usable session id (1-64 of A-Z a-z 0-9 _ -: it names a directory),
    else ValueError saying so."""
    if not SESSION_ID.fullmatch(value):
        raise ValueError(f"session id {value[:80]!r} must be 1 to 64 characters from A-Z a-z 0-9 _ -")
    return value


def session_id(request: Request, user: str | None) -> str | None:
    """The session the request names (its X-Session-Id header or its `user` field), checked;
    None: a request without a session."""
    header = request.headers.get(SESSION_HEADER)
    if header is not None and user is not None and header != user:
        raise APIError(400, f"the X-Session-Id header ({header!r}) and the user field ({user!r}) name "
                            "different sessions", param="user", code="invalid_session_id")
    value = header if header is not None else user
    if value is None:
        return None
    try:
        return check_session_id(value)
    except ValueError as exc:
        raise APIError(400, str(exc), param="user" if header is None else None, code="invalid_session_id") from None


def served_names(lm, settings) -> tuple[str, ...]:
    """The model ids the server answers to (the first names it in answers that name none):
    `served_model_names`, or the model's own name. ValueError for an empty or repeated one."""
    names = tuple(settings.served_model_names) or (lm.name,)
    if any(not isinstance(name, str) or not name.strip() for name in names) or len(set(names)) != len(names):
        raise ValueError(f"served model names must be distinct, non-empty strings, got {list(names)}")
    return names


def check_model(model: str | None, names: tuple[str, ...]) -> None:
    """404 unless `model` is one of the names the server answers to (None: not given, fine)."""
    if model is not None and model not in names:
        raise APIError(404, f"the model {model!r} does not exist here; this server serves "
                            f"{', '.join(map(repr, names))}", param="model", code="model_not_found")


def max_choices(settings) -> int:
    """The most choices (`n`) a request may ask for: each is a sequence of its own."""
    return min(settings.max_sessions, settings.max_pending)


def check(body: GenerationBody, lm, settings) -> None:
    """What both generation endpoints check first: the model, best_of, n, and the fields this
    server does not implement (refused unless empty)."""
    check_model(body.model, served_names(lm, settings))
    if body.best_of not in (None, 1):
        raise APIError(400, "best_of: one candidate per choice is supported (best_of 1; n asks for several "
                            "choices)", param="best_of", code="invalid_value")
    most = max_choices(settings)
    if body.n is not None and not 1 <= body.n <= most:
        raise APIError(400, f"n must be in 1..{most} (each choice is a sequence of its own: at most "
                            f"--max-sessions and --max-pending), got {body.n}", param="n", code="invalid_value")
    refuse_unknown(body, ignored=IGNORED, acted_on=ACTED_ON["chat" if isinstance(body, ChatBody) else "completion"])
    if body.stream_options is not None:
        refuse_unknown(body.stream_options, "stream_options")


def prompts_of(body: GenerationBody) -> list | None:
    """The prompts of a completion whose `prompt` lists several (strings, or token lists), as
    vLLM and OpenAI take a batch: None for one prompt (a string, a token list, a list of one)."""
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        return prompt
    return None


def check_choices(request: Request, body: GenerationBody, lm, settings, seed: int) -> int:
    """n > 1 or a list of prompts (choices.py): no session, no Idempotency-Key, at most
    `max_choices` sequences in all, and every choice's seed (`seed`: the server's, when the
    request gives none) within 2**63 - 1. The first choice's seed."""
    check(body, lm, settings)
    prompts = prompts_of(body)
    what, param = ("a list of prompts", "prompt") if prompts else ("n > 1", "n")
    if session_id(request, body.user) is not None:
        raise APIError(400, f"{what} is for requests without a session: a session continues one conversation, and "
                            "each choice is a conversation of its own (drop the user field and the X-Session-Id "
                            "header)", param=param, code="invalid_value")
    if request.headers.get(answers.HEADER) is not None:
        raise APIError(400, f"{what} cannot be combined with an Idempotency-Key (a key keeps one answer of a "
                            "session)", param=param, code="invalid_value")
    if prompts and len(prompts) * (body.n or 1) > (most := max_choices(settings)):
        raise APIError(400, f"{len(prompts)} prompts x n = {body.n or 1} are {len(prompts) * (body.n or 1)} "
                            f"sequences, above this server's {most} at once (--max-sessions and --max-pending)",
                       param="prompt", code="invalid_value")
    base = seed if body.seed is None else body.seed
    if base + (body.n or 1) > 2**63:
        raise APIError(400, f"seed: choice {body.n - 1} would sample with seed {base + body.n - 1}, past 2**63 - 1",
                       param="seed", code="invalid_value")
    return base


def max_tokens(value: int | None, name: str, settings) -> int:
    """The reply's length bound `name` asks for (None: the server's default), within the server's limit."""
    if value is None:
        return settings.default_max_tokens
    if value < 1:
        raise APIError(400, f"{name} must be at least 1, got {value}", param=name, code="invalid_value")
    if value > settings.max_tokens:
        raise APIError(400, f"{name} {value} is above this server's limit of {settings.max_tokens}",
                       param=name, code="invalid_value")
    return value


def max_tokens_of(body: GenerationBody, chat: bool, settings) -> int:
    """The request's reply bound: a chat's max_completion_tokens, else its max_tokens."""
    if chat:
        return max_tokens(body.max_completion_tokens if body.max_completion_tokens is not None
                          else body.max_tokens,
                          "max_completion_tokens" if body.max_completion_tokens is not None
                          else "max_tokens", settings)
    return max_tokens(body.max_tokens, "max_tokens", settings)


def check_messages(messages: list[Message]) -> None:
    """Every chat message's content, checked before a session is touched."""
    for i, message in enumerate(messages):
        message_text(message, i)


def sampling(body: GenerationBody, vocab_size: int) -> dict:
    """The request's sampling fields as BrainConfig settings for its own tokens (the
    session's own settings stay); 400 for a token id outside the vocabulary."""
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty")
    chosen = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    if chosen.get("top_k") == -1:
        chosen["top_k"] = 0  # vLLM's "off"
    if body.logit_bias is not None:
        bias = {}
        for key, amount in body.logit_bias.items():
            if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
                raise APIError(400, f"logit_bias: {key[:40]!r} is not a token id in 0..{vocab_size - 1}",
                               param="logit_bias", code="invalid_value")
            bias[int(key)] = float(amount)
        chosen["logit_bias"] = logit_bias_text(bias)
    return chosen


GRAMMAR_FIELDS = ("response_format", "grammar", "json_schema", "structured_outputs", "guided_json", "guided_regex",
                  "guided_choice", "guided_grammar")


def grammar_of(body: GenerationBody) -> tuple[Grammar, str] | None:
    """What the request's reply must match (brain/grammar.py), and the field that asked; None:
    free text. 400 naming the field for a grammar that cannot be read, or for two asked at once."""
    asked = [name for name in GRAMMAR_FIELDS if getattr(body, name) is not None]
    if body.response_format is not None and body.response_format.type == "text":
        if body.response_format.json_schema is not None:
            raise APIError(400, "response_format.json_schema is for type json_schema", param="response_format",
                           code="invalid_value")
        asked.remove("response_format")
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"{asked[0]} and {asked[1]} both constrain the reply: give one", param=asked[1],
                       code="invalid_value")
    name = asked[0]
    try:
        return _grammar(name, getattr(body, name)), name
    except GrammarError as exc:
        raise APIError(400, f"{name}: {exc}", param=name, code="invalid_value") from None


def _grammar(name: str, value) -> Grammar:
    if name == "response_format":
        if value.type == "json_object":
            if value.json_schema is not None:
                raise GrammarError("json_schema is for type json_schema, not json_object")
            return Grammar.json_object()
        if value.json_schema is None:
            raise GrammarError("type json_schema needs its json_schema: {\"name\": ..., \"schema\": {...}}")
        return Grammar.json_schema(value.json_schema.schema_)
    if name == "structured_outputs":
        given = {key: item for key, item in value.model_dump(by_alias=True).items()
                 if item is not None and item is not False}
        if len(given) != 1:
            raise GrammarError(f"give one of json, regex, choice, grammar, json_object, got {sorted(given) or 'none'}")
        (kind, item), = given.items()
        name, value = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                       "grammar": "guided_grammar", "json_object": "json_object"}[kind], item
    if name == "json_object":
        return Grammar.json_object()
    if name in ("json_schema", "guided_json"):
        return Grammar.json_schema(value)
    if name == "grammar":
        return Grammar.gbnf(value)
    if name == "guided_grammar":  # vLLM takes GBNF or Lark
        return Grammar.lark(value) if is_lark(value) else Grammar.gbnf(value)
    if name == "guided_regex":
        return Grammar.regex(value)
    return Grammar.choice(value)  # guided_choice


def constraint_of(body: GenerationBody, lm, tools=None):
    """The request's grammar made ready for `lm`'s tokens (run off the event loop: a large
    grammar takes a while to build), or None; 400 naming the field when it cannot be used.
    `tools` (server/tools.py): a tool_choice that requires a call holds the reply to one."""
    asked = grammar_of(body)
    called = tools.grammar() if tools is not None else None
    if called is not None:
        if asked is not None:
            raise APIError(400, f"tool_choice and {asked[1]} both constrain the reply: give one", param=asked[1],
                           code="invalid_value")
        asked = called, "tools"
    if asked is None:
        return None
    grammar, name = asked
    try:
        return grammar.constraint(lm)
    except GrammarError as exc:
        raise APIError(400, f"{name}: {exc}", param=name, code="invalid_value") from None


def stop_ids(body: GenerationBody, vocab_size: int) -> set[int]:
    ids = set(body.stop_token_ids or ())
    if any(not 0 <= token < vocab_size for token in ids):
        raise APIError(400, f"stop_token_ids: token ids must be in 0..{vocab_size - 1}",
                       param="stop_token_ids", code="invalid_value")
    return ids


def logprob_options(body: GenerationBody, chat: bool, key: str | None) -> tuple[int | None, bool]:
    """(the alternatives to list per token, None: no logprobs; whether to echo the prompt)."""
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        top, echo = (body.top_logprobs or 0) if body.logprobs else None, False
    else:
        top, echo = body.logprobs, body.echo
    if key is not None and (top is not None or echo):
        raise APIError(400, "logprobs and echo cannot be combined with an Idempotency-Key (a replayed answer does "
                            "not keep them)", param="logprobs" if top is not None else "echo",
                       code="invalid_value")
    return top, echo


def check_ids(ids: list[int], vocab_size: int) -> None:
    if any(not 0 <= token < vocab_size for token in ids):
        raise APIError(400, f"prompt: token ids must be in 0..{vocab_size - 1}", param="prompt",
                       code="invalid_value")


def too_long(what: str, tokens: int, limit: int, why: str, param: str, *, at_least: bool = False) -> APIError:
    """`at_least`: `tokens` is a lower bound (LoadedModel.fewest_tokens), found without encoding."""
    return APIError(400, f"{what} is {'at least ' if at_least else ''}{tokens} tokens, more than the {limit} "
                         f"{why}", param=param, code="context_length_exceeded")


def prompt_limit(lm, config: BrainConfig) -> tuple[int, str]:
    """The most tokens a fresh brain may take, and why: the model's positions (a prompt
    past the budget is pruned to it by the session's policy, as `run` does), or the budget
    less the row of the reply's first token when nothing is ever evicted (policy none with
    at_capacity stop)."""
    if evicts_nothing(config):
        return config.budget - 1, ("of the context budget less one row for the reply (policy none with "
                                   "at_capacity stop evicts nothing)")
    return lm.max_positions, f"positions of {lm.name} (a longer prompt cannot be read at all)"


def check_room(conversation: Conversation, adding: int, param: str) -> None:
    """A session that evicts nothing (policy none, at_capacity stop) takes a request only if
    its input and the reply's first token fit under its budget; else a 400 and the session
    stays as it was. Other policies make room themselves, tick by tick."""
    brain = conversation.brain
    if not evicts_nothing(brain.config):
        return
    held = brain.state.rows_per_layer + len(conversation.forced) + len(brain.pending_input)  # unread counts
    budget = brain.config.budget
    if held + adding + 1 > budget:
        name = f"session {conversation.id!r}" if conversation.id else "the session"
        raise APIError(400, f"{name} is full: it holds {held} of its {budget} rows and this request adds "
                            f"{adding} more, plus one for the reply; under policy none with at_capacity stop "
                            "nothing is evicted, so the session can take no more (start a new session)",
                       param=param, code="context_length_exceeded")
