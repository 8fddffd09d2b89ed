"""What the server reads and how it refuses: the request bodies (pydantic models, strict:
a number is not a string of one), their validation into OpenAI's error shape, and the
checks on their fields that need no model or session (content parts, stop strings).

A refusal is an `APIError`: its HTTP status and the body {"error": {"message", "type",
"param", "code"}} that OpenAI's clients read.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from .hermes import call_text, response_text

MAX_TOP = 20  # alternatives a token's logprobs may list (OpenAI's limit)
MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_DEPTH = 64  # JSON nesting a body may have (a chat body needs 5: messages.N.content.N.text)
SURROGATE = re.compile("[\ud800-\udfff]")  # a lone surrogate: JSON's "\ud800" escape, not valid Unicode
# fields OpenAI clients may send that change nothing here (docs/server.md lists them); any other
# field this server does not implement is refused with 400 naming it, unless it is empty
# (null, false, 0, "", [] or {}: "off")
IGNORED = ("store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier")
# other servers' fields whose value changes the answer, per body: taken at the value this server acts
# on, refused (400 naming the field) at any other; the chat always ends with the assistant's prefix
# (its reply is the assistant's turn), and a reply's text holds every token but the one ending it
ACTED_ON = {"chat": {"add_generation_prompt": True, "skip_special_tokens": False},
            "completion": {"skip_special_tokens": False}}
# why a field OpenAI's clients send on a message or a content part is refused (any other is too)
NOT_HONOURED = {"name": "the chat is written from each message's role and content only",
                "cache_control": "a session keeps its own context; no prompt cache is set by request"}


class APIError(Exception):
    """A request the server refuses, with its HTTP status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# -- request bodies ---------------------------------------------------------------------------

Number = Annotated[float, Field(strict=True)]  # a JSON number, not a string of one


JSONSchema = dict | StrictBool  # a JSON schema: an object (or true / false)


class JSONSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema the reply must match, and its name."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr = Field(max_length=64)
    schema_: JSONSchema = Field({}, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None  # the reply matches the schema whole either way


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema
    (positronic/brain/grammar.py holds the reply to it)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of a JSON schema, a regular expression, a choice of
    strings, a grammar (GBNF or Lark), or any JSON object."""
    model_config = ConfigDict(extra="forbid")
    json_: JSONSchema | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class GenerationBody(BaseModel):
    """What both generation endpoints take. A field not defined here is refused (400 naming
    it) unless it is empty or in IGNORED (rules.check): nothing is silently ignored.
    The sampling fields go to steps/sample.py, the run's own sampler."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = Field(None, ge=0, le=2, allow_inf_nan=False)  # 1e999 parses as inf
    top_p: Number | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1)  # vLLM's: -1 (or 0) is off
    min_p: Number | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: Number | None = Field(None, ge=0.01, le=100, allow_inf_nan=False)
    presence_penalty: Number | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[StrictStr, Annotated[float, Field(strict=True, ge=-100, le=100, allow_inf_nan=False)]] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=64)  # vLLM's: token ids that end the reply
    # what the reply must match (one of these; rules.grammar_of): OpenAI's, llama-server's and vLLM's names
    response_format: ResponseFormat | None = None
    grammar: StrictStr | None = None  # llama-server's: GBNF
    json_schema: JSONSchema | None = None  # llama-server's
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    guided_json: JSONSchema | StrictStr | None = None  # vLLM's older names
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = Field(None, min_length=1)
    guided_grammar: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = 1
    best_of: StrictInt | None = None
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # vLLM's and llama.cpp's extension: generate max_tokens whatever comes


class CompletionBody(GenerationBody):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP)  # the alternatives to list per token
    echo: StrictBool = False  # the prompt before the reply, in the text (and its tokens in logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An assistant message's call, as an answer gave it (server/tools.py)."""
    model_config = ConfigDict(extra="forbid")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (its content may then be null)
    tool_call_id: StrictStr | None = None  # a tool's answer: the call it answers


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema of its arguments
    strict: StrictBool | None = None  # its calls match the schema whole either way ("required", a named function)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatBody(GenerationBody):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP)


def empty(value) -> bool:
    """Whether a field's value means "off" (null, false, 0, "", [] or {}): an unknown field so
    set asks for nothing and is accepted."""
    return value is None or value in (False, "", [], {})


def refuse_unknown(model: BaseModel, at: str | None = None, ignored: tuple[str, ...] = (),
                   acted_on: dict | None = None) -> None:
    """400 naming the first field of `model` that its class does not define (`at`: where the
    model is in the body, "messages.0"), unless it is empty or `ignored`: nothing is silently
    dropped. A field of `acted_on` is taken at the value this server acts on, refused at any
    other (there `false` is not "off": it asks for something else)."""
    for name, value in (model.model_extra or {}).items():
        if acted_on and name in acted_on:
            if value != acted_on[name] or type(value) is not type(acted_on[name]):
                param = f"{at}.{name}" if at else name
                raise APIError(400, f"{param}: this server acts as {name}={json_value(acted_on[name])} only, got "
                                    f"{json_value(value)}", param=param, code="unsupported")
            continue
        if name not in ignored and not empty(value):
            param = f"{at}.{name}" if at else name
            why = f" ({NOT_HONOURED[name]})" if name in NOT_HONOURED else ""
            raise APIError(400, f"{param} is not supported by this server{why}", param=param, code="unsupported")


def json_value(value) -> str:
    """`value` as JSON spells it (true, false, null), for a message."""
    return json.dumps(value) if isinstance(value, (bool, type(None))) else repr(value)


def _too_deep() -> APIError:
    return APIError(400, f"the request body is nested too deeply (more than {MAX_DEPTH} levels of arrays and "
                         "objects)", code="invalid_json")


def check_json(data) -> None:
    """400 for what JSON parses but no text or field may hold: nesting deeper than MAX_DEPTH,
    and a lone surrogate (a "\\ud800" escape without its pair) in any string or field name,
    which no tokenizer can read and no response can echo. The walks are iterative (no recursion
    limit): a quick one over the containers, then, only if it found something, one that names
    the first problem in the body's order."""
    search = SURROGATE.search
    level, depth, found = [data], 0, False
    while level and not found:  # one level of nesting at a time
        depth += 1
        if depth > MAX_DEPTH:
            raise _too_deep()
        inner = []
        for value in level:
            if type(value) is dict:
                if any(map(search, value)):
                    found = True
                    break
                value = value.values()
            for item in value:
                kind = type(item)
                if kind is str:
                    if search(item):
                        found = True
                        break
                elif kind is list or kind is dict:
                    inner.append(item)
            if found:
                break
        level = inner
    if not found:
        return
    todo = [(data, ())]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            if (found := search(value)) is not None:
                raise _surrogate(path, found.group(), "contains")
        elif isinstance(value, (dict, list)):
            items = list(value.items() if isinstance(value, dict) else enumerate(value))
            for key, _ in items:
                if isinstance(key, str) and (found := search(key)) is not None:
                    raise _surrogate(path, found.group(), "has a field name that contains")
            todo.extend((item, path + (key,)) for key, item in reversed(items))


def _surrogate(path: tuple, char: str, what: str) -> APIError:
    name = ".".join(map(str, path)) or None
    return APIError(400, f"{name or 'the request body'}: {what} a lone surrogate (U+{ord(char):04X}); text must be "
                         "valid Unicode", param=name, code="invalid_value")


async def read_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's JSON body as `model`, or a 400 naming the first problem."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    check_json(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        # a field of several forms gets an error per form, each naming the form it tried
        # ("prompt.list[int].1"): the deepest of the first field's names where it went wrong
        field = errors[0]["loc"][:1]
        error = max((e for e in errors if e["loc"][:1] == field),
                    key=lambda e: len([p for p in e["loc"] if not _union_member(p)]))
        param = ".".join(str(part) for part in error["loc"] if not _union_member(part)) or None
        raise APIError(400, f"{param}: {error['msg']}" if param else error["msg"], param=param,
                       code="invalid_value" if param else "invalid_request") from None


def _union_member(part) -> bool:
    """Whether a pydantic error location part names a union's member type, not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none"))


def message_text(message: Message, index: int) -> str:
    """A message's content as text: a string ("" is fine), or its text parts joined; a 400
    naming `messages.N.content` when it has none (missing, null, no parts) or a part is not text,
    and naming the field when the message or a part has one this server does not honour
    (`name`, `cache_control`, ...: refuse_unknown). An assistant's tool calls are the text the
    model wrote for them after its content, and a tool's answer the user turn that carries it
    (server/tools.py)."""
    refuse_unknown(message, f"messages.{index}")
    param = f"messages.{index}.content"
    if message.tool_calls and message.role != "assistant":
        raise APIError(400, f"messages.{index}.tool_calls: only an assistant message makes tool calls",
                       param=f"messages.{index}.tool_calls", code="invalid_value")
    if message.tool_call_id is not None and message.role != "tool":
        raise APIError(400, f"messages.{index}.tool_call_id: only a tool message answers a call",
                       param=f"messages.{index}.tool_call_id", code="invalid_value")
    content = message.content
    if message.tool_calls and content in (None, "", []):
        return call_text([(call.function.name, call.function.arguments) for call in message.tool_calls])
    if content is None or content == []:
        got = ("missing" if "content" not in message.model_fields_set else "null" if content is None
               else "an empty list")
        raise APIError(400, f"{param}: a message needs its content (a string, or a list of text parts), got {got}",
                       param=param, code="invalid_value")
    if isinstance(content, str):
        text = content
    else:
        texts = []
        for i, part in enumerate(content):
            if part.type != "text":
                raise APIError(400, f"{param}: only text parts are supported, not {part.type!r}", param=param,
                               code="invalid_value")
            refuse_unknown(part, f"{param}.{i}")
            if part.text is None:
                raise APIError(400, f"{param}.{i}.text: a text part needs its text", param=f"{param}.{i}.text",
                               code="invalid_value")
            texts.append(part.text)
        text = "".join(texts)
    if message.tool_calls:
        return call_text([(call.function.name, call.function.arguments) for call in message.tool_calls], text)
    return response_text(text) if message.role == "tool" else text


def stops_of(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters",
                       param="stop", code="invalid_value")
    return [s for s in stops if s]
