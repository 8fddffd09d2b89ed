"""The frame of the live view, drawn from a Snapshot: header, context panel, histogram, last
edits, progress bar and the input line.

Every function here is pure (a snapshot in, a rich renderable out): no terminal input or
output, no threads, so tests draw frames without running a loop. Colours and marks come from
`positronic.tui.style`.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.segment import Segment
from rich.style import Style
from rich.text import Span, Text

from .snapshot import Snapshot
from .style import LEVELS, PANEL_BG, PANEL_FG, level, row_style, token_style

BOTTOM_ROWS = 6  # inner height of the histogram / action panels
HIST_WIDTH = 36  # outer width of the histogram panel
HIDDEN_STYLE = Style(italic=True)  # not dim: terminals halve a dim colour's lightness
BARS = " ▁▂▃▄▅▆▇█"
INPUT_HINT = "type a line, Enter adds it as a user turn, Esc clears"


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


# --- the input line ---------------------------------------------------------------------


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

