"""Tool calls: OpenAI's `tools` and `tool_choice`, written and read in the Hermes convention.

    tools = Tools.of(body)                    # None: the request offers no tools (or tool_choice "none")
    tools.preamble()                          # the system text that describes them to the model
    tools.grammar()                           # what a reply must match ("required" or a named function), or None
    tools.calls(reply_text)                   # the calls a finished reply makes, or None: a plain answer

The model is told of the tools in a system message (the first one, extended, or one put
first): each function's signature as JSON between `<tools>` and `</tools>` (compact: every token
of it is read at each session's start), and that a call is a
JSON object of its name and arguments between `<tool_call>` and `</tool_call>`, the convention
of Hermes and Qwen2.5 (their templates write tools the same way), which models tuned for tool
use read. With `tool_choice` "required" or a named function the reply is held to exactly that
form (brain/grammar.py: the arguments to the function's own JSON schema); with "auto" the model
chooses, and a reply that makes calls in that form (or is one bare call object) is answered as
`tool_calls` with finish_reason "tool_calls". A tool's answer (a message of role "tool") is read
as a user turn between `<tool_response>` and `</tool_response>`, and an assistant message's
earlier calls as the text the model wrote for them (hermes.py: `call_text`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..brain.grammar import JSON_OPTIONS, Grammar, GrammarError
from .hermes import CLOSE, OPEN
from .schemas import APIError

CALL = re.compile(re.escape(OPEN) + r"\s*(\{.*?\})\s*" + re.escape(CLOSE), re.DOTALL)
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for a function name


class CallScanner:
    """A streamed reply that may call tools, piece by piece: text is sent as it comes until a
    call may begin (a `<tool_call>` tag, or a reply that opens with `{`: a bare call object);
    from there it is held, to be sent as calls or, if it was none, as text at the end."""

    def __init__(self):
        self.sent, self.held, self.holding = "", "", False

    def push(self, text: str) -> str:
        """The part of `text` safe to send now."""
        if self.holding:
            self.held += text
            return ""
        text, self.held = self.held + text, ""
        if not self.sent.strip() and (self.sent + text).lstrip().startswith("{"):
            self.holding, self.held = True, text
            return ""
        if (at := text.find(OPEN)) >= 0:
            self.holding, self.held, text = True, text[at:], text[:at]
        else:  # a tail that may grow into the tag waits for the next piece
            keep = max((k for k in range(1, len(OPEN)) if text.endswith(OPEN[:k])), default=0)
            self.held, text = text[len(text) - keep:], text[:len(text) - keep]
        self.sent += text
        return text

    def flush(self) -> str:
        """What is held, once the reply has ended and made no calls."""
        text, self.held = self.held, ""
        return text


@dataclass(frozen=True)
class Tools:
    """The functions a request offers ({name: function object}, in order) and how the reply may
    use them: "auto" (the model chooses), "required" (one call, to any), or a function's name
    (one call, to it)."""

    functions: dict[str, dict]
    choice: str

    @classmethod
    def of(cls, body) -> Tools | None:
        """The request's tools, checked (400 naming the field), or None: none offered, or
        tool_choice "none" (the reply is plain text; the tools are not described)."""
        tools, choice = body.tools, body.tool_choice
        if not tools:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice needs tools to choose from", param="tool_choice",
                               code="invalid_value")
            return None
        functions = {}
        for i, tool in enumerate(tools):
            name = tool.function.name
            if not NAME.fullmatch(name):
                raise APIError(400, f"tools.{i}.function.name: {name[:80]!r} must be 1-64 of a-z A-Z 0-9 _ . -",
                               param=f"tools.{i}.function.name", code="invalid_value")
            if name in functions:
                raise APIError(400, f"tools.{i}.function.name: {name!r} is offered twice",
                               param=f"tools.{i}.function.name", code="invalid_value")
            functions[name] = tool.function.model_dump(exclude_none=True, by_alias=True)
        if choice is None:
            choice = "auto"
        elif not isinstance(choice, str):
            choice = choice.function.name
            if choice not in functions:
                raise APIError(400, f"tool_choice names {choice!r}, which is not among the tools",
                               param="tool_choice", code="invalid_value")
        if choice == "none":
            return None
        return cls(functions, choice)

    def preamble(self) -> str:
        """The system text describing the tools and how to call one."""
        signatures = "\n".join(json.dumps(f, ensure_ascii=False, separators=(",", ":")) for f in self.functions.values())
        return (f"Functions you may call:\n<tools>\n{signatures}\n</tools>\n"
                f'Call one as {OPEN}\n{{"name": ..., "arguments": {{...}}}}\n{CLOSE}')

    def grammar(self) -> Grammar | None:
        """The form the reply must take: one call in the Hermes tags to a function `choice`
        allows, its arguments valid under that function's parameters; None for "auto"."""
        if self.choice == "auto":
            return None
        names = list(self.functions) if self.choice == "required" else [self.choice]
        options = [{"type": "object", "properties": {"name": {"const": name},
                                                     "arguments": self.functions[name].get("parameters",
                                                                                           {"type": "object"})},
                    "required": ["name", "arguments"], "additionalProperties": False} for name in names]
        schema = {"anyOf": options, "x-guidance": JSON_OPTIONS}
        lark = f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: %json {json.dumps(schema)}"
        try:
            return Grammar.lark(lark)
        except GrammarError as exc:
            raise APIError(400, f"tools: {exc}", param="tools", code="invalid_value") from None

    def calls(self, text: str) -> tuple[str, list[dict]] | None:
        """(the reply's content before its calls, OpenAI's tool_calls) when a finished reply
        calls offered functions; None when it is a plain answer."""
        found = [match for match in CALL.finditer(text)]
        bodies = [match.group(1) for match in found]
        content = text[:found[0].start()].strip() if found else ""
        if not found and text.strip().startswith("{"):  # one bare call object, as some models write it
            bodies = [text.strip()]
        calls = []
        for body in bodies:
            try:
                call = json.loads(body)
            except ValueError:
                return None
            if (not isinstance(call, dict) or call.get("name") not in self.functions
                    or not isinstance(call.get("arguments", {}), dict)):
                return None
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"],
                                       "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}})
        return (content, calls) if calls else None
