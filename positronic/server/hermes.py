"""Tool calls and tools' answers as text, in the Hermes convention (server/tools.py): what an
assistant's calls and a tool's answer are written as in a conversation's context."""

from __future__ import annotations

import json

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def response_text(content: str) -> str:
    """A tool's answer (a "tool" message) as the user turn that carries it to the model."""
    return f"<tool_response>\n{content}\n</tool_response>"


def call_text(calls: list[tuple[str, dict | str]], content: str = "") -> str:
    """The text an assistant's calls [(name, arguments)] are written as in the context (what the
    model writes for them), after its content if it has any. Arguments given as a JSON string are
    read first, so that the same call is the same text however it was spelt."""
    parts = [content] if content else []
    for name, arguments in calls:
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # kept as sent: the model sees the string it was given
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        parts.append(f"{OPEN}\n{call}\n{CLOSE}")
    return "\n".join(parts)
