"""What the live view's tests share, each a fixture (no test module imports another).

States are real (random:tiny, a byte-level tokenizer: one character per token, BOS is
'<s>'), brightness is set by hand, frames go through rich's recording console.
"""

import io

import pytest
from rich.console import Console

from positronic import StateManager
from positronic.brain.loop import Brain, BrainConfig

TEXT = "The old lighthouse keeper climbed the spiral stairs every night"  # 63 tokens + BOS


def _console(width=100, height=40) -> Console:
    return Console(record=True, width=width, height=height, force_terminal=True, color_system="truecolor",
                   file=io.StringIO())


def _crafted(lm, text=TEXT, **config) -> Brain:
    """A real brain over `text` (no ticks run)."""
    state = StateManager.from_tokens(lm, [lm.bos_id] + lm.encode(text))
    return Brain(state, BrainConfig(**{"budget": 48, "repairer": "self", **config}))


def _set_brightness(brain: Brain, values: list[float]) -> None:
    """Store brightness the only way there is: as Step 4's argument, here with no edits."""
    report = brain.state.apply([], tick=brain.tick, brightness=values)
    assert not report.rebuilt, report.error
    assert brain.state.mirror.brightness() == values


def _styles_by_row(text, texts) -> dict:
    """The style each row's first character is drawn with, in a context rendered on one
    line (so row r starts at the summed length of the rows before it)."""
    assert "\n" not in text.plain and text.plain == "".join(texts)
    styles, offset = {}, 0
    for row, t in enumerate(texts):
        if t:
            styles[row] = next(s.style for s in text.spans if s.start <= offset < s.end)
        offset += len(t)
    return styles


def _plain(renderable, width=100, height=40) -> str:
    c = _console(width, height)
    c.print(renderable)
    return c.export_text()


@pytest.fixture(scope="session")
def lighthouse() -> str:
    """The text the crafted states hold (63 tokens + BOS)."""
    return TEXT


@pytest.fixture(scope="session")
def console():
    """console(width=100, height=40) -> a recording truecolor Console that writes to memory."""
    return _console


@pytest.fixture(scope="session")
def crafted():
    """crafted(lm, text=TEXT, **config) -> a real Brain over `text` (no ticks run), budget 48."""
    return _crafted


@pytest.fixture(scope="session")
def set_brightness():
    """set_brightness(brain, values): store brightness as Step 4's argument, with no edits."""
    return _set_brightness


@pytest.fixture(scope="session")
def styles_by_row():
    """styles_by_row(text, texts) -> {row: the style of its first character} in a one-line context."""
    return _styles_by_row


@pytest.fixture(scope="session")
def plain():
    """plain(renderable, width=100, height=40) -> the renderable drawn as plain text."""
    return _plain
