"""A chat session's history as its client holds it: checked against each request's messages.

A running chat session reads only a request's new user messages; the earlier ones are its own
memory. A client that edits or regenerates a message would otherwise go on with a conversation
it no longer sees. So each session keeps its messages (role, text; its replies as they were
sent) and a request's earlier messages must be the same as the last ones of that record (a
client may send its whole history, the last few messages, or only the new one). When they
differ, the server refuses with 409 `history_mismatch` (the default) or, with
`serve --history-edits rebuild`, starts the session again from the request's messages.

The record is checkpointed with the session (the note of session.save); a session saved before
it, or begun by a completion, has none and is not checked.
"""

from __future__ import annotations

Message = tuple[str, str]  # (role, text)


class History:
    """The messages of one chat session; None: not known (nothing is checked)."""

    def __init__(self, messages: list[Message] | None = None):
        self.messages = messages

    def differs(self, earlier: list[Message]) -> int | None:
        """The index (in `earlier`) of the first message that is not the record's, or None
        when `earlier` is the record's last messages (or nothing is known)."""
        if self.messages is None or not earlier:
            return None
        if len(earlier) > len(self.messages):
            return 0
        mine = self.messages[len(self.messages) - len(earlier):]
        return next((i for i, (a, b) in enumerate(zip(earlier, mine)) if a != b), None)

    def said(self, messages: list[Message]) -> None:
        if self.messages is not None:
            self.messages.extend(messages)

    def replied(self, text: str, *, again: bool) -> bool:
        """The session's reply as sent; `again`: a retried request's reply, which replaces the
        part its first try recorded. Whether the record changed."""
        if self.messages is None:
            return False
        if again and self.messages and self.messages[-1][0] == "assistant":
            if self.messages[-1][1] == text:
                return False
            self.messages[-1] = ("assistant", text)
        else:
            self.messages.append(("assistant", text))
        return True

    def note(self) -> list[list[str]] | None:
        return None if self.messages is None else [list(m) for m in self.messages]

    @classmethod
    def from_note(cls, saved) -> History:
        """The history a checkpoint kept (absent: unknown); ValueError if it is malformed."""
        if saved is None:
            return cls(None)
        if not (isinstance(saved, list) and all(isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m)
                                                for m in saved)):
            raise ValueError("the session's chat history is malformed")
        return cls([(role, text) for role, text in saved])
