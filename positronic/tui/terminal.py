"""The terminal side of the live view: keys read in cbreak mode, the line being typed, and the
rich `Live` that redraws the latest frame.

Input: when stdin is a terminal, the last line is an input line ("> " and what is being
typed). A `KeyReader` thread reads keys in cbreak mode (no echo, no line editing by the
terminal; ISIG stays on, so Ctrl-C is still SIGINT and ends the run cleanly) and edits the
line with the pure `edit_line`; Enter puts the line into the Runner's input queue, which the
loop thread drains between ticks (Brain.say): neither the key thread nor the render thread
touches the brain. The terminal's settings come back on every way out.

Threads: `Live` redraws from its own thread (4 times a second) and `KeyReader` reads keys in
another; both read only the `LiveView`'s current snapshot and prompt, which the other threads
replace (never mutate).
"""

from __future__ import annotations

import codecs
import os
import select
import threading
import unicodedata

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.segment import Segment

from .render import frame
from .snapshot import Snapshot

ESC = "\x1b"
ENTER = ("\r", "\n")
BACKSPACE = ("\x7f", "\x08")
CLEAR_LINE = "\x15"  # Ctrl-U


def split_keys(text: str) -> list[str]:
    """The keys in what one read from the terminal gave: characters, with an escape sequence
    (an arrow key's "\x1b[A", "\x1bOP", Alt+x) kept whole as one key; a lone Esc is a key."""
    keys, i = [], 0
    while i < len(text):
        if text[i] != ESC or i + 1 == len(text):
            keys.append(text[i])
            i += 1
            continue
        j = i + 2
        if text[i + 1] == "[":  # CSI: parameters, then one final byte in @..~
            while j < len(text) and not "@" <= text[j] <= "~":
                j += 1
            j += 1
        elif text[i + 1] == "O":  # SS3: one more character
            j += 1
        keys.append(text[i:j])
        i = j
    return keys


def edit_line(buffer: str, key: str) -> tuple[str, str | None]:
    """The input line after `key`, and the line submitted by it (None unless Enter on a line
    that is not blank): printable characters are added, Backspace removes the last one, Esc
    and Ctrl-U clear the line, a tab is a space; other keys (arrows, control keys) do nothing."""
    if key in ENTER:
        return "", buffer if buffer.strip() else None
    if key in BACKSPACE:
        return buffer[:-1], None
    if key in (ESC, CLEAR_LINE):
        return "", None
    if key == "\t":
        return buffer + " ", None
    if len(key) == 1 and not unicodedata.category(key).startswith("C"):
        return buffer + key, None
    return buffer, None


class KeyReader:
    """Keys from the terminal `fd`, read in cbreak mode by a daemon thread and passed one by
    one to `on_key` (in that thread). A context manager: entering saves the terminal's
    settings and switches to cbreak (no echo, no line buffering; ISIG stays, so Ctrl-C still
    sends SIGINT); leaving stops the thread and puts the settings back, however it is left.
    A terminal whose settings cannot be read gives no keys (`active` False), not an error."""

    POLL_S = 0.05

    def __init__(self, fd: int, on_key):
        self.fd, self.on_key = fd, on_key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="positronic-keys", daemon=True)
        self._saved = None
        self.active = False

    def __enter__(self) -> "KeyReader":
        import termios
        import tty

        try:
            self._saved = termios.tcgetattr(self.fd)
        except (termios.error, OSError, ValueError):
            return self
        try:
            tty.setcbreak(self.fd, termios.TCSANOW)
            self._thread.start()
        except BaseException:
            termios.tcsetattr(self.fd, termios.TCSANOW, self._saved)
            raise
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        import termios

        if not self.active:
            return
        self._stop.set()
        try:
            self._thread.join(timeout=1.0)
        finally:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self.active = False

    def _read(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.fd], [], [], self.POLL_S)
                data = os.read(self.fd, 1024) if ready else None
            except (OSError, ValueError):
                return
            if data == b"":  # the terminal went away
                return
            if data:
                for key in split_keys(decoder.decode(data)):
                    self.on_key(key)


# --- the live frame ---------------------------------------------------------------------


class LiveView:
    """The renderable `Live` redraws: the frame of the latest snapshot at the console's size.

    Redraws outnumber snapshots on slow models, so the rendered lines are cached per
    (snapshot, size) and a redraw of an unchanged frame only re-emits them.
    """

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot  # replaced (never mutated) by the loop thread
        self.prompt: str | None = None  # the input line (None: none shown), replaced by the key thread
        self.reserve = 0  # screen lines to leave free below the frame (for the summary)
        self._key: tuple | None = None
        self._held: Snapshot | None = None
        self._lines: list[list[Segment]] = []

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The frame's size on a console of `width` × `height`."""
        # -1: the line the cursor rests on after the frame
        return width, max(height - 1 - self.reserve, 8)

    def changed(self, console: Console) -> bool:
        """Whether a redraw now would draw something new (a new snapshot, or a resize)."""
        width, height = console.size
        return (id(self.snapshot), self.prompt, *self.size(width, height)) != self._key

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        snapshot, prompt = self.snapshot, self.prompt  # one read: the other threads may swap them meanwhile
        width, height = self.size(options.max_width, options.size.height)
        key = (id(snapshot), prompt, width, height)
        if key != self._key:
            self._lines = console.render_lines(frame(snapshot, width, height, prompt), options.update(height=None),
                                               pad=True)
            self._key, self._held = key, snapshot  # hold it so its id is not reused
        for index, line in enumerate(self._lines):
            if index:
                yield Segment.line()
            yield from line


class FrameLive(Live):
    """A Live that skips a timed redraw when its LiveView has nothing new to draw: on a slow
    model most refreshes would rewrite the same frame, and writing it costs the tick loop
    GIL time."""

    def __init__(self, view: LiveView, **kwargs):
        super().__init__(view, **kwargs)
        self.view = view

    def refresh(self) -> None:
        if self.view.changed(self.console):
            super().refresh()
