"""The live terminal view of a run (rich): the context coloured by brightness, the counters,
the brightness distribution, the last edits in words and a progress bar.

    run_live(brain, lm, runner, show_prompt=True)   # what `run.py` calls on a terminal

Threads: rich's `Live` redraws from its own thread (4 times a second) while the tick loop
mutates the mirror in the main thread. The render thread therefore never reads the brain:
`on_tick` copies what a frame needs into an immutable `Snapshot` of plain Python lists, at
most once per refresh interval, and every frame is built from the latest snapshot alone.
The render functions below are pure (snapshot in, renderable out), so tests draw frames
without running a loop.

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

Input: when stdin is a terminal, the last line is an input line ("> " and what is being
typed). A `KeyReader` thread reads keys in cbreak mode (no echo, no line editing by the
terminal; ISIG stays on, so Ctrl-C is still SIGINT and ends the run cleanly) and edits the
line with the pure `edit_line`; Enter puts the line into the Runner's input queue, which the
loop thread drains between ticks (Brain.say): neither the key thread nor the render thread
touches the brain. The terminal's settings come back on every way out.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import queue
import select
import threading
import time
import unicodedata
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.segment import Segment
from rich.style import Style
from rich.text import Span, Text

from positronic import steps

from ..brain.runner import Runner, RunResult, summary

if TYPE_CHECKING:  # imported for annotations only: the loop module pulls in torch
    from ..brain.loop import Brain, TickRecord
    from ..models import LoadedModel

REFRESH_PER_SECOND = 4
REPAIR_HIGHLIGHT_TICKS = 12  # a repaired token stays highlighted this many ticks
ACTION_LOG = 200  # action lines kept (the view shows the newest that fit)
RATE_WINDOW = 32  # ticks in the tokens/s moving average
BOTTOM_ROWS = 6  # inner height of the histogram / action panels
HIST_WIDTH = 36  # outer width of the histogram panel

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
NOTE_SECONDS = 10.0  # a refused line's message stays on the input line this long
HIDDEN_STYLE = Style(italic=True)  # not dim: terminals halve a dim colour's lightness
BARS = " ▁▂▃▄▅▆▇█"


# --- snapshot: the only thing the render thread reads -----------------------------------


@dataclass(frozen=True)
class Snapshot:
    """Everything one frame shows, copied out of the brain at a tick boundary."""

    model: str
    device: str
    dtype: str
    policy: str
    rule: str
    tick: int  # the brain's tick (continues across resumes)
    done: int  # ticks run by this invocation
    total: int | None  # ticks this invocation will run (None: no limit)
    texts: list[str]  # per live row, in cache order
    brightness: list[float]
    sources: list[str]
    born: list[int]  # tick each live row entered the context
    budget: int
    sinks: int
    protect: int
    window: int
    bright_max: float  # top of the colour scale (the rule's start value)
    counts: dict[str, int]
    cache_mb: float
    tok_s: float
    elapsed: float
    actions: list[str]  # newest last
    status: str = "running"  # running | finished | interrupted | policy stopped
    resumed: bool = False
    pending_input: int = 0  # typed tokens queued and not added yet
    input_note: str = ""  # why the last line was refused, while it is recent
    recalled: list[bool] = field(default_factory=list)  # per live row: recall brought it back
    pinned: list[bool] = field(default_factory=list)  # per live row: pinned (never evicted)
    restored: int | None = None  # rows recall brought back so far (None: recall is off)
    # "brightness", or "layers" when layers keep different rows (policy smartkv): then the colour
    # and the histogram show how many of the model's layers hold each token (0..bright_max)
    measure: str = "brightness"
    rows_per_layer: int | None = None  # per-layer rows: what the budget bounds (texts: the union)


def take_snapshot(brain: "Brain", lm: "LoadedModel", *, done: int = 0, total: int = 0, tok_s: float = 0.0,
                  elapsed: float = 0.0, actions: list[str] | None = None, status: str = "running",
                  resumed: bool = False, input_note: str = "") -> Snapshot:
    """Copy what a frame needs out of the brain (one pass over the live rows)."""
    mirror, cfg = brain.state.mirror, brain.config
    entries = mirror.ledger.entries
    rows = [entries[i] for i in mirror.live.ledger_ids]
    if mirror.layers is not None:  # colour by how many layers (or kv heads: per-head rows) still hold each token
        measure = "layers" if mirror.layers.num_layers == lm.num_layers else "kv heads"
        shown, scale = mirror.layers.occupancy(mirror.live.ledger_ids), mirror.layers.num_layers
    else:
        shown, scale, measure = [e.brightness for e in rows], float(steps.RULES[cfg.brightness].start), "brightness"
    return Snapshot(
        model=lm.name, device=str(lm.device), dtype=str(lm.dtype).removeprefix("torch."), policy=cfg.policy,
        rule=cfg.brightness, tick=brain.tick, done=done, total=total,
        texts=[e.text for e in rows], brightness=[float(b) for b in shown], measure=measure,
        rows_per_layer=None if mirror.layers is None else len(mirror.layers),
        sources=[e.source for e in rows], born=[e.tick_born for e in rows],
        budget=cfg.budget, sinks=cfg.sinks, protect=cfg.protect, window=cfg.window,
        bright_max=float(scale), counts=dict(brain.counts),
        cache_mb=brain.state.cache.memory_usage_mb(), tok_s=tok_s, elapsed=elapsed,
        actions=list(actions or ()), status=status, resumed=resumed,
        pending_input=len(brain.pending_input), input_note=input_note,
        recalled=[e.resurrections > 0 for e in rows], pinned=[e.pinned for e in rows],
        restored=None if brain.policy.recall is None else brain.policy.recall.restored)


# --- colours and styles -----------------------------------------------------------------


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


# --- the context ------------------------------------------------------------------------


@lru_cache(maxsize=16384)  # token texts repeat (a vocabulary's worth at most): draw each once
def display_text(text: str) -> str:
    """A token's text as the view shows it: a newline becomes '↵' plus a real line break,
    tabs a space, other control characters '·' (they would move the cursor)."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("↵\n")
        elif ch == "\t":
            out.append(" ")
        elif unicodedata.category(ch) in ("Cc", "Cf"):
            out.append("·")
        else:
            out.append(ch)
    return "".join(out)


def layout_tokens(texts: list[str], width: int) -> list[list[tuple[int, str]]]:
    """Lay the tokens out in lines of at most `width` cells: a token that does not fit on
    the current line starts the next one (tokens are the words here); one wider than a line
    is folded. Returns lines of (row, piece of its text)."""
    width = max(width, 1)
    lines: list[list[tuple[int, str]]] = [[]]
    used = 0
    for row, text in enumerate(texts):
        for k, segment in enumerate(display_text(text).split("\n")):
            if k:  # after a newline
                lines.append([])
                used = 0
            w = cell_len(segment)
            if not w:
                continue
            if used + w > width and w <= width and used:
                lines.append([])
                used = 0
            while used + w > width:  # fold what still does not fit
                head, segment = split_cells(segment, width - used)
                if head:
                    lines[-1].append((row, head))
                lines.append([])
                used, w = 0, cell_len(segment)
            lines[-1].append((row, segment))
            used += w
    return lines


def split_cells(text: str, cells: int) -> tuple[str, str]:
    """`text` cut after at most `cells` cells (at least one character when cells > 0 and the
    line is empty, so folding always progresses)."""
    used = 0
    for i, ch in enumerate(text):
        used += cell_len(ch)
        if used > cells:
            return text[:i], text[i:]
    return text, ""


def render_context(snapshot: Snapshot, width: int, height: int) -> Text:
    """The live context in `height` lines of `width` cells, following the end; when it does
    not fit, the first line says how many earlier tokens are hidden."""
    lines = layout_tokens(snapshot.texts, width)
    hidden = 0
    if len(lines) > height:
        lines = lines[len(lines) - max(height - 1, 1):]
        hidden = next((piece[0] for line in lines for piece in line), len(snapshot.texts))
    # Built as one string plus spans (neighbours with the same style share one span):
    # Text.append per token costs several times more, and the render thread holds the GIL
    # the tick loop needs.
    parts: list[str] = []
    spans: list[Span] = []
    offset = 0
    if hidden:
        parts.append(f"… {hidden} earlier token{'s' if hidden != 1 else ''} hidden\n")
        offset = len(parts[0])
        spans.append(Span(0, offset - 1, HIDDEN_STYLE))
    for index, line in enumerate(lines):
        if index:
            parts.append("\n")
            offset += 1
        for row, piece in line:
            style, end = row_style(snapshot, row), offset + len(piece)
            if spans and spans[-1].style is style and spans[-1].end == offset:
                spans[-1] = Span(spans[-1].start, end, style)
            else:
                spans.append(Span(offset, end, style))
            parts.append(piece)
            offset = end
    return Text("".join(parts), spans=spans, no_wrap=True, overflow="crop", end="")


def legend(snapshot: Snapshot) -> Text:
    """What the marks mean, for the context panel's subtitle."""
    text = Text()
    for label, lvl in (("dim", 0), ("bright", LEVELS - 1)):
        text.append(f"{label}", token_style(lvl))
        text.append(" ")
    text.append("sink", token_style(LEVELS - 1, sink=True))
    text.append(" ")
    text.append("protected", token_style(LEVELS - 1, protected=True))
    text.append(" ")
    text.append("repaired", token_style(LEVELS - 1, fresh=True))
    text.append(" ")
    text.append("user", token_style(LEVELS - 1, user=True))
    text.append(" ")
    text.append("recalled", token_style(LEVELS - 1, recalled=True))
    text.append(" ")
    text.append("pinned", token_style(LEVELS - 1, pinned=True))
    text.append(" ")
    text.append("newest", token_style(LEVELS - 1, newest=True))
    text.append(f"  0..{snapshot.bright_max:g}")  # the scale: short, so the legend fits at 80 columns
    if snapshot.measure != "brightness":  # per-layer rows: "layers" or "kv heads"
        text.append(f" {snapshot.measure}")
    return text


# --- header, histogram, actions, progress -----------------------------------------------


def render_header(snapshot: Snapshot, width: int | None = None) -> Text:
    """Two lines: what is running, then the counters; on a narrow terminal (`width`) each
    line takes its compact form, so nothing is cut on 80 columns."""
    s, c = snapshot, snapshot.counts
    status_style = {"running": "green", "finished": "bold green"}.get(s.status, "bold yellow")
    rule = f"/{s.rule}" if s.measure == "brightness" else ""  # a per-layer policy has no brightness rule
    full = [("Positronic Brain", "bold"), (f"  {s.model} on {s.device} ({s.dtype})  policy {s.policy}{rule}", ""),
            (f"  [{s.status}]", status_style)]
    compact = [("Positronic", "bold"), (f"  {s.model} {s.device}/{s.dtype}  {s.policy}{rule}", ""),
               (f"  [{s.status}]", status_style)]
    if s.resumed:
        full.append(("  resumed", "cyan"))
        compact.append(("  resumed", "cyan"))
    fields = [("tick", f"{s.done}/{'∞' if s.total is None else s.total}")]
    if s.tick != s.done:  # resumed: the brain's own tick count differs
        fields.append(("brain tick", str(s.tick)))
    fields += [
        ("tok/s", f"{s.tok_s:.1f}"),
        ("live", f"{len(s.texts) if s.rows_per_layer is None else s.rows_per_layer}/{s.budget}"),
        ("culls", str(c.get("culls", 0))),
        ("repairs", str(c.get("repairs", 0))),
    ]
    if s.rows_per_layer is not None:  # layers hold different rows: how many tokens they hold between them
        fields.insert(fields.index(("culls", str(c.get("culls", 0)))), ("tokens", str(len(s.texts))))
    if s.restored is not None:
        fields.append(("recalled", str(s.restored)))
    fields += [("rebuilds", str(c.get("rebuilds", 0))), ("cache", f"{s.cache_mb:.1f} MiB")]
    def counters(names) -> list[tuple[str, str]]:
        parts = []
        for index, (label, value) in enumerate(fields):
            parts += [(("  " if index else "") + names.get(label, label) + " ", "dim"), (value, "bold")]
        return parts

    def fitting(*forms):
        return next((form for form in forms if width is None or sum(len(t) for t, _ in form) <= width), forms[-1])

    text = Text(no_wrap=True, overflow="ellipsis")
    for part, style in fitting(full, compact):
        text.append(part, style)
    text.append("\n")
    for part, style in fitting(counters({}), counters(SHORT_LABELS)):
        text.append(part, style)
    return text


SHORT_LABELS = {"tok/s": "t/s", "culls": "cull", "repairs": "rep", "recalled": "rec", "rebuilds": "rbd",
                "cache": "kv", "brain tick": "brain"}


def histogram_counts(brightness: list[float], bright_max: float, bins: int) -> list[int]:
    """How many rows fall in each of `bins` equal bins over 0..bright_max."""
    counts = [0] * bins
    for b in brightness:
        fraction = b / bright_max if bright_max > 0 else 0.0
        counts[min(max(int(fraction * bins), 0), bins - 1)] += 1
    return counts


def render_histogram(snapshot: Snapshot, width: int, height: int) -> Text:
    """A bar chart of the brightness distribution (`height - 2` rows of bars, each column
    in its bin's colour) over an axis line (0 … the scale's top) and a line with min / mean /
    max. A policy that does not score brightness (every row at the top) says so instead."""
    if snapshot.policy != "brightness" and snapshot.measure == "brightness":
        return Text(f"not scored: policy {snapshot.policy}\nranks rows by its own\nscore (docs/policies.md)",
                    "dim", no_wrap=True, overflow="ellipsis", end="")
    bins, rows = max(width, 1), max(height - 2, 1)
    counts = histogram_counts(snapshot.brightness, snapshot.bright_max, bins)
    top = max(counts) or 1
    eighths = [round(c / top * rows * 8) if c else 0 for c in counts]
    eighths = [max(e, 1) if c else 0 for e, c in zip(eighths, counts)]  # a non-empty bin always shows
    colours = [token_style(level((i + 0.5) / bins * snapshot.bright_max, snapshot.bright_max)) for i in range(bins)]
    chars: list[str] = []
    spans: list[Span] = []
    for r in range(rows):
        floor = (rows - 1 - r) * 8
        for column in range(bins):
            bar = BARS[min(max(eighths[column] - floor, 0), 8)]
            if bar != " ":
                spans.append(Span(len(chars), len(chars) + 1, colours[column]))
            chars.append(bar)
        chars.append("\n")
    text = Text("".join(chars), spans=spans, no_wrap=True, overflow="crop", end="")
    top_label = f"{snapshot.bright_max:g}"
    text.append("0" + "─" * max(bins - 1 - len(top_label), 0) + top_label + "\n", "dim")
    b = snapshot.brightness
    if b:
        stats = f"min {min(b):.0f} mean {sum(b) / len(b):.0f} max {max(b):.0f}"
        text.append(stats if len(stats) <= bins else f"{min(b):.0f}/{sum(b) / len(b):.0f}/{max(b):.0f}", "dim")
    return text


def render_actions(snapshot: Snapshot, height: int) -> Text:
    """The newest action lines that fit in `height` lines, newest last."""
    lines = snapshot.actions[-height:] if height > 0 else []
    text = Text("\n".join(lines) if lines else "no edits yet", no_wrap=True, overflow="ellipsis", end="")
    if not lines:
        text.stylize("dim")
    return text


def render_progress(snapshot: Snapshot, width: int) -> "SideBySide":
    """A progress bar for this invocation's ticks, with elapsed and estimated remaining time."""
    s = snapshot
    if s.total is None:  # no limit: a pulsing bar, no estimate
        label = f" {s.done}/∞  {clock(s.elapsed)} elapsed"
    else:
        left = (s.total - s.done) / s.tok_s if s.tok_s > 0 else 0.0
        label = f" {s.done}/{s.total}  {clock(s.elapsed)} elapsed" + (
            f"  ~{clock(left)} left" if s.status == "running" and s.done < s.total else "")
    bar_width = max(width - cell_len(label), 1)
    bar = ProgressBar(total=None if s.total is None else max(s.total, 1), completed=s.done, width=bar_width,
                      complete_style="#21918c", finished_style="#5ec962")
    return SideBySide((bar, bar_width), (Text(label, no_wrap=True, overflow="crop", end=""), width - bar_width))


def clock(seconds: float) -> str:
    """h:mm:ss (or m:ss under an hour)."""
    m, sec = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


# --- describing actions in words --------------------------------------------------------


def short(text: str, limit: int = 24) -> str:
    """A token text for the action log: one line, trimmed, quoted."""
    text = display_text(text).replace("\n", "").strip()
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return f"'{text}'"


def describe_actions(tick: int, actions: list[dict], row_text, decode, ledger_text=lambda i: "?") -> list[str]:
    """Each position-editing action in words; `row_text(row)` gives a live row's text before
    the edits, `decode(ids)` the text of new tokens, `ledger_text(id)` a ledger entry's (what
    a restore brings back). Adds are left out: the generated token shows at the end of the
    context anyway."""
    lines = []
    for action in actions:
        kind = action.get("action")
        if kind == "replace_pair":
            p1, p2 = action["original_pos1"], action["original_pos2"]
            old = row_text(p1) + row_text(p2)
            lines.append(f"t{tick} replace {p1}–{p2} {short(old)} → {short(decode(action['new_token_ids']))}")
        elif kind == "delete":
            lines.append(f"t{tick} delete {action['position']} {short(row_text(action['position']))}")
        elif kind == "restore":
            ids = action["ledger_ids"]
            text = "".join(ledger_text(i) for i in sorted(ids))
            lines.append(f"t{tick} recall {len(ids)} row{'s' * (len(ids) != 1)} {short(text)}")
        elif kind == "drop":
            count = len(action["rows"][0])
            lines.append(f"t{tick} drop {count} row{'s' * (count != 1)} per layer")
    return lines


class ActionRecorder:
    """An Observer (positronic.brain.loop): writes each tick's edits in words into `lines`.

    The texts must be read before Step 4 moves the rows, so `before_apply` reads them
    (only the rows the actions touch) in the loop thread; the view copies `lines` into
    its snapshots.
    """

    def __init__(self, lm: "LoadedModel", keep: int = ACTION_LOG):
        self.lm = lm
        self.lines: deque[str] = deque(maxlen=keep)

    def before_apply(self, brain: "Brain", actions: list[dict], brightness=None) -> None:
        live, entries = brain.state.mirror.live.ledger_ids, brain.state.mirror.ledger.entries

        def row_text(row: int) -> str:
            return entries[live[row]].text if isinstance(row, int) and 0 <= row < len(live) else "?"

        def ledger_text(ledger_id: int) -> str:
            return entries[ledger_id].text if isinstance(ledger_id, int) and 0 <= ledger_id < len(entries) else "?"

        self.lines.extend(describe_actions(brain.tick, actions, row_text, self.lm.decode, ledger_text))

    def after_apply(self, brain: "Brain", actions: list[dict], report) -> None:
        if report.rebuilt:
            self.lines.append(f"t{brain.tick} REBUILT the cache from the mirror: {report.error}")


# --- the input line ---------------------------------------------------------------------

ESC = "\x1b"
ENTER = ("\r", "\n")
BACKSPACE = ("\x7f", "\x08")
CLEAR_LINE = "\x15"  # Ctrl-U
INPUT_HINT = "type a line, Enter adds it as a user turn, Esc clears"


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


def render_input(snapshot: Snapshot, prompt: str, width: int) -> Text:
    """One line: "> " and the end of what is being typed, a cursor, and on the right what is
    still being fed (or why the last line was refused, or a hint while the line is empty)."""
    if snapshot.input_note:
        status, style = snapshot.input_note, "bold red"
    elif snapshot.pending_input:
        n = snapshot.pending_input
        status, style = f"feeding {n} typed token{'s' if n != 1 else ''}", "bold"
    else:
        status, style = ("" if prompt else INPUT_HINT), "dim"
    typed = display_text(prompt).replace("\n", "")
    room = max(width - 3, 1)  # less "> " and the cursor
    # the status takes what the typed text leaves, and half the line when that is long
    status_room = room - 2 - min(cell_len(typed), room - room // 2)
    if cell_len(status) > status_room:
        status = split_cells(status, status_room - 1)[0] + "…" if status_room >= 4 else ""
    if status:
        room -= cell_len(status) + 2
    typed = tail_cells(typed, room)  # the end of a long line: where the cursor is
    text = Text(no_wrap=True, overflow="crop", end="")
    text.append("> ", "bold")
    text.append(typed)
    text.append(" ", Style(reverse=True))
    if status:
        text.append(" " * (width - cell_len(text.plain) - cell_len(status)))
        text.append(status, style)
    return text


def tail_cells(text: str, cells: int) -> str:
    """The longest end of `text` that takes at most `cells` cells."""
    used, i = 0, len(text)
    while i > 0 and used + cell_len(text[i - 1]) <= cells:
        i -= 1
        used += cell_len(text[i])
    return text[i:]


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


# --- the frame --------------------------------------------------------------------------


class SideBySide:
    """Renderables in columns of fixed widths, lines zipped. A Table.grid does the same but
    measures its cells first, which costs more than drawing them."""

    def __init__(self, *columns: tuple[object, int]):
        self.columns = columns  # (renderable, width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        blocks = [console.render_lines(r, options.update(width=w, height=None), pad=True) for r, w in self.columns]
        height = max(len(block) for block in blocks)
        for index in range(height):
            for block, (_, w) in zip(blocks, self.columns):
                yield from block[index] if index < len(block) else [Segment(" " * w)]
            yield Segment.line()


def frame(snapshot: Snapshot, width: int = 120, height: int = 40, prompt: str | None = None) -> Group:
    """The whole view for a terminal of `width` × `height`: header (2 lines), context
    panel (at least 3 rows), histogram + action panels (up to BOTTOM_ROWS rows, fewer on a
    short terminal, dropped below 2), progress bar (1 line), and with a `prompt` (what is
    being typed) the input line (1 line)."""
    fixed = 2 + 2 + 1 + (prompt is not None)
    room = height - fixed - 3 - 2  # what the bottom panels can have after a 3-row context
    bottom = min(BOTTOM_ROWS, room) if room >= 2 else 0
    context_rows = max(height - fixed - (bottom + 2 if bottom else 0), 3)
    parts = [
        render_header(snapshot, width),
        Panel(render_context(snapshot, width - 4, context_rows), title="context", title_align="left",
              subtitle=legend(snapshot), subtitle_align="right", height=context_rows + 2,
              style=Style(color=PANEL_FG, bgcolor=PANEL_BG)),
    ]
    if bottom:
        hist_width = min(HIST_WIDTH, width // 3)
        parts.append(SideBySide(
            (Panel(render_histogram(snapshot, hist_width - 4, bottom),
                   title="brightness" if snapshot.measure == "brightness" else f"{snapshot.measure} per token", title_align="left",
                   height=bottom + 2), hist_width),
            (Panel(render_actions(snapshot, bottom), title="last edits", title_align="left", height=bottom + 2),
             width - hist_width)))
    parts.append(render_progress(snapshot, width))
    if prompt is not None:
        parts.append(render_input(snapshot, prompt, width))
    return Group(*parts)


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


# --- the run ----------------------------------------------------------------------------


@contextlib.contextmanager
def loading(model: str, console: Console | None = None):
    """A spinner line while the model loads and the prompt is prefilled (SmolLM2 takes ~6 s on
    a CPU, longer on its first run): without it the screen stays blank until the view opens.
    The line goes when the block ends, however it ends (Ctrl-C included)."""
    console = console or Console()
    with console.status(f"loading {model} …", spinner="dots"):
        yield


def run_live(brain: "Brain", lm: "LoadedModel", runner: Runner, *, show_prompt: bool,
             console: Console | None = None, refresh_per_second: float = REFRESH_PER_SECOND,
             keys: int | None = None) -> RunResult:
    """Run `runner` under the live view, then print the summary below its last frame.

    Ctrl-C ends the run cleanly (Runner saves the session); the final frame stays on
    screen. `show_prompt` is False on a resumed run (the header says so). `keys`: a terminal
    to read typed lines from (the input line; they go into `runner.inputs`). A refused line
    is said on the input line and in the edits panel (not on stderr, under the view).
    Returns the RunResult.
    """
    console = console or Console()
    recorder = ActionRecorder(lm)
    brain.observers.append(recorder)
    interval = 1.0 / refresh_per_second
    stamps: deque[float] = deque(maxlen=RATE_WINDOW + 1)
    last = [0.0]  # time of the last snapshot
    note = ["", 0.0]  # the last refusal and when it came (the loop thread writes it)

    def snap(done: int, elapsed: float, status: str = "running") -> Snapshot:
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else (
            done / elapsed if elapsed > 0 else 0.0)
        return take_snapshot(brain, lm, done=done, total=runner.ticks, tok_s=rate, elapsed=elapsed,
                             actions=list(recorder.lines)[-BOTTOM_ROWS * 4:], status=status,
                             resumed=not show_prompt,
                             input_note=note[0] if time.perf_counter() - note[1] < NOTE_SECONDS else "")

    def refused(message: str) -> None:
        note[:] = message, time.perf_counter()
        recorder.lines.append(f"t{brain.tick} {message}")
        last[0] = 0.0  # the next tick shows it

    view = LiveView(snap(0, 0.0))
    runner.on_refused = refused
    if keys is not None and runner.inputs is None:
        runner.inputs = queue.SimpleQueue()

    def on_tick(record: "TickRecord", result: RunResult) -> None:
        now = time.perf_counter()
        stamps.append(now)
        # a snapshot costs a pass over the live rows: take one per refresh, not per tick
        if now - last[0] >= interval or record.stopped or result.ticks == runner.ticks:
            last[0] = now
            view.snapshot = snap(result.ticks, result.seconds)

    def on_key(live: Live):
        def edit(key: str) -> None:  # in the key thread: the line, and the queue the loop drains
            view.prompt, line = edit_line(view.prompt or "", key)
            if line is not None:
                runner.inputs.put(line)
            live.refresh()
        return edit

    try:
        with FrameLive(view, console=console, auto_refresh=True, refresh_per_second=refresh_per_second,
                       vertical_overflow="crop") as live:
            reader = contextlib.nullcontext() if keys is None else KeyReader(keys, on_key(live))
            try:
                with reader:
                    view.prompt = "" if getattr(reader, "active", False) else None
                    result = runner.run(on_tick)
            finally:
                view.prompt = None  # the run is over: no more input
            closing = summary(brain, lm, result)
            status = ("interrupted" if result.interrupted else "policy stopped" if result.stopped else "finished")
            view.snapshot = snap(result.ticks, result.seconds, status)
            view.reserve = closing.count("\n") + 1  # the last frame and the summary fit on one screen
            live.refresh()
    finally:
        brain.observers.remove(recorder)
    console.print(closing, markup=False, highlight=False)
    return result
