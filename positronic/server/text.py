"""Text out of the server (positronic/server/app.py): a reply as text.

    Reply(lm, anchor, stops)                # generated ids -> the text a client may see so far

A chat comes in as token ids through positronic/brain/chat.py's ChatFormat (a run's conversation
mode writes its chats the same way), with the model's chat template, as chat.py writes one user turn:
the template's frame is encoded with its special tokens meant, each message's text is encoded
literally (a special token typed into a message stays text). Without a usable template the
plain form of chat.py is used: "\\nUser: …\\nAssistant:", and "\\nSystem: …" for a system
message. A later turn of a running session is chat.user_turn's, so a session reads the same
frame whether its turns came in one request or in several.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


class StopScanner:
    """Finds the first of a request's stop strings in text that arrives piece by piece; holds
    back a tail that could still become one, so no part of a stop string is ever sent."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(the text now safe to send, whether a stop string was found: nothing after it counts)."""
        text = self._held + text
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self._held = ""
            return text[:min(found)], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back tail, once no more text comes."""
        text, self._held = self._held, ""
        return text


class Reply:
    """One request's generated text, token by token: decoded in context (after `anchor`, the
    token before the reply, so a leading space survives), a trailing incomplete UTF-8
    character held back until the next token completes it, the end-of-sequence token and the
    stop strings ending it, `max_tokens` bounding it. `finish_reason` is "stop" or "length"
    once it is done; `text` is everything sent. With `ignore_eos` the end-of-sequence token
    is text like any other and only max_tokens (or a stop string) ends the reply. A token of
    `stop_ids` (vLLM's stop_token_ids) ends it as end-of-sequence does, out of its text."""

    def __init__(self, lm, anchor: int, max_tokens: int, stops: Sequence[str] = (), *, ignore_eos: bool = False,
                 stop_ids: Collection[int] = ()):
        self.lm, self.anchor, self.max_tokens = lm, anchor, max_tokens
        # the tokens that end the reply and are not part of its text: end-of-sequence, stop_token_ids
        self.enders = set(stop_ids) | (set() if ignore_eos else {lm.eos_id})
        self.ids: list[int] = []  # generated, the token that ends the reply (end-of-sequence, a stop id) excluded
        self.tokens = 0  # generated, the end-of-sequence token included
        self.text = ""
        self.finish_reason: str | None = None
        self._prefix = lm.decode([anchor])
        self._decoded = 0  # characters of the decoded reply passed on to the stop scanner
        self._stops = StopScanner(stops)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_id: int, *, stopped: bool = False, complete: bool = False) -> str:
        """Take the next generated token; returns the text it makes sendable (maybe "").
        `stopped`: the brain cannot go on (policy none at capacity with --at-capacity stop);
        `complete`: the reply's grammar is whole and takes nothing more (finish_reason stop)."""
        if self.done:
            raise RuntimeError("the reply is already finished")
        self.tokens += 1
        if token_id in self.enders:
            piece = self._finish("stop")
        else:
            self.ids.append(token_id)
            decoded = self._decode()
            ready = len(decoded) - (1 if decoded.endswith("\ufffd") else 0)
            piece, hit = self._stops.push(decoded[self._decoded:ready])
            self._decoded = max(self._decoded, ready)
            if hit:
                self.finish_reason = "stop"
            elif complete:
                piece += self._finish("stop")
            elif stopped or self.tokens >= self.max_tokens:
                piece += self._finish("length")
        self.text += piece
        return piece

    def cut(self) -> str:
        """The reply stops here, unfinished (the server is shutting down): what was held back (an
        incomplete character, a tail that could have begun a stop string) is sent, so the
        client has every token generated. Its finish_reason stays None."""
        if self.done:
            return ""
        rest = self._decode()[self._decoded:] if self.ids else ""
        self._decoded += len(rest)
        piece, hit = self._stops.push(rest)
        piece = piece if hit else piece + self._stops.flush()
        self.text += piece
        return piece

    def _decode(self) -> str:
        full = self.lm.decode([self.anchor] + self.ids)
        return full[len(self._prefix):] if full.startswith(self._prefix) else self.lm.decode(self.ids)

    def _finish(self, reason: str) -> str:
        """End the reply: what was held back (an incomplete character, a tail that could have
        begun a stop string) is sent, up to a stop string it completes."""
        self.finish_reason = reason
        rest = self._decode()[self._decoded:] if self.ids else ""
        self._decoded += len(rest)
        piece, hit = self._stops.push(rest)
        return piece if hit else piece + self._stops.flush()
