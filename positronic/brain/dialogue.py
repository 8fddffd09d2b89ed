"""Conversation mode (llama-cli's -cnv): each line a user turn, the model's reply, then the next line.

    dialogue = Dialogue(lm, lines, reply_tokens=128)
    first = dialogue.wait()                                  # the first line (None: no input at all)
    brain = Brain.start(lm, dialogue.opening(first, system="Be brief."), config)
    Runner(brain, lm.name, None, dialogue=dialogue).run(on_tick)

The context is one conversation in the model's chat template, written as the server writes its
chats (chat.ChatFormat): the first line opens it (after a system message, where one is given),
a reply is generated until the model ends its turn (its end-of-sequence token: ChatML's
<|im_end|>; `ignore_eos` leaves only the limit), its `grammar` is whole (each reply keeps to
it from its first token), or `reply_tokens` tokens, the template's
closing is read in after it, and the next line is said (Brain.say: the same frame as a line
typed into a running story). At the end of the input the run ends. The policy keeps the
context inside its budget across turns as it does for a story: a conversation may be far
longer than the budget.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable

from .chat import END_OF_INPUT, ChatFormat, TurnRefused
from .grammar import Grammar
from .loop import Brain, TickRecord

# --chat-template by name: the common formats, for a model whose tokenizer carries none (a GGUF
# or a base model) or the wrong one; any other value is a Jinja template itself, or a file of one
CHAT_TEMPLATES = {
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "phi3": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "plain": "",  # no template: chat.py's plain form ("\nUser: ...\nAssistant:")
}


class Dialogue:
    """Turns of a conversation for `Runner` (the module docstring). `lines`: the typed lines
    (a queue a LineReader fills, END_OF_INPUT at its end); `reply_tokens`: the most tokens a
    reply may take (None: no limit); `on_refused(message)`: a line too long for a turn;
    `prompt()`: called before each wait (a terminal's "> ")."""

    def __init__(self, lm, lines: queue.SimpleQueue, *, reply_tokens: int | None, ignore_eos: bool = False,
                 on_refused: Callable[[str], None] = lambda message: None, prompt: Callable[[], None] = lambda: None,
                 grammar: Grammar | None = None):
        self.lm, self.lines, self.reply_tokens = lm, lines, reply_tokens
        self.grammar = grammar  # each reply keeps to it (a fresh constraint a reply), and ends when it is whole
        self.format = ChatFormat(lm)
        self.enders = set() if ignore_eos or lm.eos_id is None else {lm.eos_id}
        self.on_refused, self.prompt = on_refused, prompt
        self.closing: deque[int] = deque()  # the template's closing of the last reply, still to be read
        self.waiting = True  # the last reply is closed: the next tick needs a line
        self.replying = False  # ticks since the last line are the reply (the turn itself is read first)
        self.reply = 0  # tokens of the reply so far
        self.replies = 0  # replies ended
        self._forcing: int | None = None  # the closing token the tick under way adds
        self.shown, self.ended = False, False  # the last tick's `after_tick`

    def opening(self, line: str, system: str | None = None) -> list[int]:
        """The first context: [a system message and] the first line, with the assistant's prefix."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": line}]
        self.waiting, self.replying, self.reply = False, True, 0
        return self.format.conversation(messages)

    def wait(self, stopping: Callable[[], bool] = lambda: False) -> str | None:
        """The next non-blank line (blocking, looking at `stopping()` ten times a second), or None
        at the end of the input or when `stopping()` says so."""
        self.prompt()
        while not stopping():
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is END_OF_INPUT:
                return None
            if line.strip():
                return line
        return None

    def before_tick(self, brain: Brain, stopping: Callable[[], bool]) -> tuple[bool, int | None]:
        """(whether the run goes on, the token the next tick must add or None to let it run): the
        closing of the last reply, token by token; then, once it is read, the next line said."""
        self._forcing = self.closing.popleft() if self.closing else None
        if self._forcing is not None:
            return True, self._forcing
        while self.waiting:
            line = self.wait(stopping)
            if line is None:
                return False, None
            try:
                brain.say(line)
            except TurnRefused as exc:
                self.on_refused(str(exc))
                continue
            self.waiting, self.replying, self.reply = False, True, 0
            self.constrain(brain)
        return True, None

    def constrain(self, brain: Brain) -> None:
        """The reply about to begin keeps to the grammar, from its first token (none: free)."""
        brain.constraint = self.grammar.constraint(self.lm) if self.grammar is not None else None

    def after_tick(self, record: TickRecord) -> tuple[bool, bool]:
        """Take the tick's record: (whether its token is the reply's text, not the turn read
        before it, the end-of-turn token or the closing; whether the reply ended with it),
        kept as `shown`, `ended` for whoever shows the tick."""
        self.shown, self.ended = self._after(record)
        return self.shown, self.ended

    def _after(self, record: TickRecord) -> tuple[bool, bool]:
        if record.rebuilt:  # nothing was added: the tick comes again
            if self._forcing is not None:
                self.closing.appendleft(self._forcing)
            return False, False
        if self._forcing is not None:
            self.waiting = not self.closing
            return False, False
        if record.source == "user" or not self.replying:
            return False, False
        self.reply += 1
        ended = record.token_id in self.enders  # its end-of-turn token: not the reply's text
        if ended or record.complete or (self.reply_tokens is not None and self.reply >= self.reply_tokens):
            self.replying = False
            self.replies += 1
            self.closing.extend(self.format.reply_end(record.token_id))
            self.waiting = not self.closing
            return not ended, True
        return True, False
