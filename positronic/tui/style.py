"""Colours and styles of the live view: a token's colour by its brightness, and its marks.

Colours: brightness is mapped onto the upper part of matplotlib's *viridis* ramp (teal →
green → yellow) in truecolor. Viridis is perceptually uniform and its lightness rises
monotonically, so "dimmer" reads as "darker" for colour-blind viewers too; rich falls back
to the nearest 256-colour entries on terminals without truecolor. The scale runs from 0 to
the brightness rule's start value (`steps.RULES[rule].start`: 255 for ttl, 10000 for vote),
the most a token can have.

Contrast: the context panel paints its own near-black background (`PANEL_BG`), so its text
never sits on the terminal's: no single text colour reads on both a dark and a light
terminal (WCAG's 4.5:1 against black and against white leaves no room). On that background
the ramp starts at a lightness floor, the darkest viridis colour that still has 4.5:1
against the panel and against every mark background (`CONTRAST_FLOOR_AT`), so even the
dimmest token is readable; the mark backgrounds are dark tints for the same reason.

Marks: sinks (the first `config.sinks` rows) sit on a dark grey background; protected rows (the
first `config.protect` rows and the most recent `config.window` rows) are underlined;
tokens a repair inserted in the last `REPAIR_HIGHLIGHT_TICKS` ticks sit on a magenta
background; tokens the user typed (ledger source "user") on a blue one; tokens recall brought
back (a ledger entry with resurrections) on a green one; pinned tokens are in italics; the
newest token is shown in reverse video.
"""

from __future__ import annotations

from functools import lru_cache

from rich.style import Style

from .snapshot import Snapshot

REPAIR_HIGHLIGHT_TICKS = 12  # a repaired token stays highlighted this many ticks

# viridis sampled at 0, 1/8, ..., 1 (matplotlib's values); linear in between
VIRIDIS = (
    (68, 1, 84), (71, 45, 123), (59, 82, 139), (44, 114, 142), (33, 145, 140),
    (40, 174, 128), (94, 201, 98), (173, 220, 48), (253, 231, 37),
)
LEVELS = 64  # brightness is quantised to this many colours, so styles can be cached
PANEL_BG = "#0c0c0c"  # the context panel's own background (see Contrast above)
PANEL_FG = "#d0d0d0"  # its border, title and notes
SINK_BG = "#262626"
REPAIR_BG = "#5c0f5c"  # magenta: written by a repair
USER_BG = "#12305a"  # blue: typed by the user
RECALL_BG = "#124225"  # green: brought back by recall
MARK_BGS = (PANEL_BG, SINK_BG, REPAIR_BG, USER_BG, RECALL_BG)
MIN_CONTRAST = 4.5  # WCAG 2 AA for normal text


def viridis(x: float) -> tuple[int, int, int]:
    """The viridis colour at `x` in 0..1 (clamped), linear between the samples."""
    x = min(max(x, 0.0), 1.0) * (len(VIRIDIS) - 1)
    i = min(int(x), len(VIRIDIS) - 2)
    t = x - i
    a, b = VIRIDIS[i], VIRIDIS[i + 1]
    return tuple(round(a[k] + (b[k] - a[k]) * t) for k in range(3))


def hex_rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def luminance(rgb: tuple[int, int, int]) -> float:
    """WCAG 2 relative luminance of an sRGB colour."""
    def linear(c: int) -> float:
        c = c / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = map(linear, rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    """WCAG 2 contrast ratio of two colours, 1 .. 21."""
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def _floor_at(steps: int = 1000) -> float:
    """The lowest point of the viridis ramp from which on every colour has MIN_CONTRAST against
    every background a token can sit on (viridis' lightness rises monotonically, so the first
    such point is the floor)."""
    backgrounds = [hex_rgb(colour) for colour in MARK_BGS]
    return next(i / steps for i in range(steps + 1)
                if all(contrast(viridis(i / steps), bg) >= MIN_CONTRAST for bg in backgrounds))


CONTRAST_FLOOR_AT = _floor_at()


def brightness_rgb(fraction: float) -> tuple[int, int, int]:
    """The colour of `fraction` (0 = dimmest, 1 = brightest; clamped): viridis from the
    contrast floor up."""
    fraction = min(max(fraction, 0.0), 1.0)
    return viridis(CONTRAST_FLOOR_AT + (1.0 - CONTRAST_FLOOR_AT) * fraction)


def level(brightness: float, bright_max: float) -> int:
    """Quantised brightness 0..LEVELS-1."""
    fraction = brightness / bright_max if bright_max > 0 else 0.0
    return min(max(int(fraction * (LEVELS - 1) + 0.5), 0), LEVELS - 1)


@lru_cache(maxsize=LEVELS * 16)
def token_style(lvl: int, *, sink: bool = False, protected: bool = False, fresh: bool = False,
                newest: bool = False, user: bool = False, recalled: bool = False, pinned: bool = False) -> Style:
    """The style of one token: colour by brightness level, plus its marks. Cached: a frame
    asks for a few hundred styles but only a few dozen distinct ones exist."""
    r, g, b = brightness_rgb(lvl / (LEVELS - 1))
    bgcolor = REPAIR_BG if fresh else RECALL_BG if recalled else USER_BG if user else SINK_BG if sink else PANEL_BG
    return Style(color=f"#{r:02x}{g:02x}{b:02x}", bgcolor=bgcolor, underline=protected or None,
                 bold=fresh or sink or recalled or None, italic=pinned or None, reverse=newest or None)


def row_style(snapshot: Snapshot, row: int) -> Style:
    """The style of live row `row` in `snapshot`."""
    n = len(snapshot.texts)
    return token_style(
        level(snapshot.brightness[row], snapshot.bright_max),
        sink=row < snapshot.sinks,
        protected=row < snapshot.protect or row >= n - snapshot.window,
        fresh=snapshot.sources[row] == "repair" and snapshot.tick - snapshot.born[row] < REPAIR_HIGHLIGHT_TICKS,
        newest=row == n - 1, user=snapshot.sources[row] == "user",
        recalled=bool(snapshot.recalled) and snapshot.recalled[row], pinned=bool(snapshot.pinned) and snapshot.pinned[row])
