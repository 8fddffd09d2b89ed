"""Input while it runs: a line the user types becomes a user turn the brain reads, one token
per tick, before it goes on generating.

    ids = user_turn(lm, "What time is it?")   # the turn's token ids ([] for a blank line)
    brain.say("What time is it?")             # queue it: the next ticks add these tokens

With a chat template (SmolLM2-Instruct: ChatML) the turn is what the template writes for one
more user message in a running conversation, plus the assistant's prefix: no system prompt
and no conversation-opening BOS (those belong at the start of a context, not in its middle).
Without one it is "\\nUser: {text}\\nAssistant:". The user's text is always literal: a
special token typed into it (`<|im_end|>`) is spelt out, never obeyed.

`LineReader` reads lines from stdin in a daemon thread into a queue that the run's own thread
drains between ticks: reading never blocks the run, and EOF just ends the reading.
"""

from __future__ import annotations

import codecs
import os
import queue
import select
import threading
from collections.abc import Sequence

END_OF_INPUT = object()  # what LineReader(..., mark_end=True) puts into its queue when the input ends
MAX_TURN_TOKENS = 2000  # a turn longer than this is refused, whatever the budget
PLAIN_TURN = ("\nUser: ", "\nAssistant:")  # the turn's frame without a chat template
_SENTINEL = "POSITRONIC_USER_TEXT_7f3a"  # stands for the user's text while the template renders


class TurnRefused(ValueError):
    """A line that cannot be fed as a user turn (too long); the message says why, in one line."""


def turn_limit(config) -> int:
    """The most tokens one turn may take under `config` (a BrainConfig): the budget less the
    rows the policy protects (sinks or the protected prefix, and the recent window), so that a
    turn is whole in the context when it ends; never more than MAX_TURN_TOKENS."""
    return min(MAX_TURN_TOKENS, config.budget - max(config.sinks, config.protect) - config.window)


def turn_frame(tokenizer) -> tuple[str, str] | None:
    """(text before, text after) the user's message in one more user turn of a running
    conversation, as the tokenizer's chat template writes it (special tokens as text), or
    None without a usable template. The difference between a conversation with and without the
    turn: what opens a conversation (BOS, a default system prompt) is not in it."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    earlier = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    try:
        base = tokenizer.apply_chat_template(earlier, tokenize=False)
        full = tokenizer.apply_chat_template(earlier + [{"role": "user", "content": _SENTINEL}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that cannot render this conversation: the plain form
        return None
    if not (isinstance(base, str) and isinstance(full, str) and full.startswith(base)
            and full.count(_SENTINEL) == 1):
        return None
    before, after = full[len(base):].split(_SENTINEL)
    return before, after


def user_turn(lm, text: str, *, limit: int = MAX_TURN_TOKENS) -> list[int]:
    """The token ids of `text` as a user turn appended to a running context of `lm` (a
    LoadedModel): [] for an empty or whitespace-only line; TurnRefused above `limit` tokens
    (the line is never cut)."""
    text = text.strip()
    if not text:
        return []
    tokenizer = lm.tokenizer

    def literal(s: str) -> list[int]:  # special tokens in the user's text stay text
        return list(tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    frame = turn_frame(tokenizer)
    if frame is None:
        ids = literal(PLAIN_TURN[0] + text + PLAIN_TURN[1])
    else:  # the frame's special tokens are meant: encoded apart from the literal text
        ids = lm.encode(frame[0]) + literal(text) + lm.encode(frame[1])
    if len(ids) > limit:
        raise TurnRefused(f"input refused: the line is {len(ids)} tokens as a user turn, more than the {limit} "
                          "a turn may take here (the budget less the protected rows); shorten it")
    return ids


ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
_MARK = "POSITRONIC_MESSAGE_{}_7f3a"  # stands for message i's text while the template renders
_REPLY = "POSITRONIC_REPLY_7f3a"


class ChatFormat:
    """Messages ({"role", "content": str}) as token ids for `lm` (a LoadedModel)."""

    def __init__(self, lm):
        self.lm = lm
        self.frame = turn_frame(lm.tokenizer)  # None: the plain form
        self._closing = self._reply_closing() if self.frame is not None else ""

    def literal(self, text: str) -> list[int]:
        """Ids of `text` with any special token in it spelt out, never obeyed."""
        # split_special_tokens flips a switch on the tokenizer itself for the encode that follows: the
        # server's tokenizing runs in its one text thread (BrainServer.off_loop), so its encodes never interleave
        return list(self.lm.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def conversation(self, messages: Sequence[dict]) -> list[int]:
        """A fresh context for `messages`, ending with the assistant's prefix: BOS (unless the
        template opens with it), the template's frame (and default system prompt, if it has
        one) around each message's literal text."""
        pieces = self._template_pieces(messages) if self.frame is not None else None
        if pieces is None:
            pieces = [(f"\n{ROLES[m['role']]}: ", m["content"].strip()) for m in messages]
            pieces.append((PLAIN_TURN[1], None))
        ids = []
        for frame, text in pieces:
            ids += self.lm.encode(frame)
            if text is not None:
                ids += self.literal(text)
        return ids if ids[:1] == [self.lm.bos_id] else [self.lm.bos_id] + ids

    def _template_pieces(self, messages: Sequence[dict]) -> list[tuple[str, str | None]] | None:
        """[(frame text, message text)] as the template renders `messages` plus the assistant's
        prefix, or None when it cannot (the plain form is used)."""
        marked = [{"role": "system" if m["role"] == "developer" else m["role"], "content": _MARK.format(i)}
                  for i, m in enumerate(messages)]
        try:
            text = self.lm.tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that cannot render this conversation
            return None
        if not isinstance(text, str):
            return None
        pieces = []
        for i, message in enumerate(messages):
            before, found, text = text.partition(_MARK.format(i))
            if not found or _MARK.format(i) in text:
                return None
            pieces.append((before, message["content"].strip()))
        pieces.append((text, None))
        return pieces

    def _reply_closing(self) -> str:
        """The template's text after an assistant message (ChatML: "<|im_end|>\\n")."""
        earlier = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": _REPLY}]
        try:
            text = self.lm.tokenizer.apply_chat_template(earlier, tokenize=False)
        except Exception:
            return ""
        return text.rpartition(_REPLY)[2] if isinstance(text, str) and _REPLY in text else ""

    def reply_end(self, last_token: int) -> list[int]:
        """The ids that close the assistant's reply before the next user turn, given the last
        token of the context: the template's closing, less the end-of-turn token when the
        model wrote it itself; none in the plain form."""
        closing = self._closing
        eos = self.lm.eos_id
        if closing and eos is not None and last_token == eos:
            end = self.lm.decode([eos])
            closing = closing[len(end):] if closing.startswith(end) else closing
        return self.lm.encode(closing) if closing else []

    def user_turn(self, text: str, limit: int) -> list[int]:
        """user_turn: the ids of one more user turn (TurnRefused above `limit` tokens)."""
        return user_turn(self.lm, text, limit=limit)


class LineReader:
    """Lines of the file descriptor `fd` (stdin) put into `lines` by a daemon thread, as they
    come; EOF (or a read error) ends the reading, and a last line without a newline counts.
    `start()` ... `close()`, or a context manager; `close()` stops the thread (it polls, so it
    never hangs on a read)."""

    POLL_S = 0.1

    def __init__(self, fd: int, lines: queue.SimpleQueue, *, mark_end: bool = False):
        self.fd, self.lines = fd, lines
        self.mark_end = mark_end  # END_OF_INPUT into `lines` once the input ends (conversation mode ends there)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="positronic-stdin", daemon=True)

    def start(self) -> "LineReader":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.POLL_S)

    def __enter__(self) -> "LineReader":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        partial = ""
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.fd], [], [], self.POLL_S)
                data = os.read(self.fd, 65536) if ready else None
            except (OSError, ValueError):  # closed, or unreadable (a tty of another process group)
                data = b""
            if data is None:
                continue
            *complete, partial = (partial + decoder.decode(data, final=not data)).split("\n")
            for line in complete:
                self.lines.put(line.removesuffix("\r"))
            if not data:
                if partial:
                    self.lines.put(partial)
                if self.mark_end:
                    self.lines.put(END_OF_INPUT)
                return
