"""The frame of the live view, drawn from snapshots of crafted real states: colours, marks,
the context, header, histogram, edits, the input line and the whole frame's size."""

import itertools
import re

import pytest

from positronic.brain.loop import Brain, BrainConfig
from positronic.tui.records import ActionRecorder
from positronic.tui.render import (INPUT_HINT, frame, legend, render_context, render_header, render_histogram,
                                   render_input)
from positronic.tui.snapshot import take_snapshot
from positronic.tui.style import (CONTRAST_FLOOR_AT, LEVELS, PANEL_BG, RECALL_BG, REPAIR_BG, REPAIR_HIGHLIGHT_TICKS,
                                  SINK_BG, USER_BG, VIRIDIS, contrast, token_style, viridis)


def luminance(rgb) -> float:
    r, g, b = rgb
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_colour_runs_from_the_dim_end_to_the_bright_end_monotonically(tiny, crafted, set_brightness, styles_by_row):
    brain = crafted(tiny)
    n = len(brain.state)
    set_brightness(brain, [255 * i / (n - 1) for i in range(n)])  # row 0 dimmest, last brightest
    snapshot = take_snapshot(brain, tiny)
    styles = styles_by_row(render_context(snapshot, 96, 30), snapshot.texts)
    colours = [tuple(styles[row].color.triplet) for row in sorted(styles)]
    assert colours[0] == viridis(CONTRAST_FLOOR_AT) and colours[-1] == VIRIDIS[-1]
    lum = [luminance(c) for c in colours]
    assert all(a <= b for a, b in zip(lum, lum[1:])), "brighter tokens never look darker"
    assert lum[-1] - lum[0] > 60, "the floor leaves a visible range"


def test_colour_scale_is_the_rules_range(tiny, crafted, set_brightness, styles_by_row):
    """vote brightness runs to 10000: 50 is at the dim end there, 5000 half way, 10000 the bright end."""
    brain = crafted(tiny, brightness="vote")
    n = len(brain.state)
    set_brightness(brain, [50.0] * 20 + [5000.0] * (n - 21) + [10000.0])
    snapshot = take_snapshot(brain, tiny)
    styles = styles_by_row(render_context(snapshot, 96, 30), snapshot.texts)
    assert tuple(styles[10].color.triplet) == viridis(CONTRAST_FLOOR_AT)
    assert luminance(viridis(CONTRAST_FLOOR_AT)) < luminance(styles[30].color.triplet) < luminance(VIRIDIS[-1])
    assert tuple(styles[n - 1].color.triplet) == VIRIDIS[-1]


def test_sinks_and_protected_rows_are_marked(tiny, crafted, styles_by_row):
    brain = crafted(tiny, sinks=4, protect=6, window=8)
    n = len(brain.state)
    snapshot = take_snapshot(brain, tiny)
    styles = styles_by_row(render_context(snapshot, 96, 30), snapshot.texts)
    for row, style in styles.items():
        assert (str(style.bgcolor.name) if style.bgcolor else None) == (SINK_BG if row < 4 else PANEL_BG), row
        assert bool(style.underline) == (row < 6 or row >= n - 8), row
    assert styles[n - 1].reverse, "the newest token stands out"
    assert not styles[n - 2].reverse


def test_repaired_tokens_are_highlighted_for_a_few_ticks(tiny, crafted, styles_by_row):
    brain = crafted(tiny)
    sm = brain.state
    brain.tick = 5
    sm.apply([{"action": "replace_pair", "original_pos1": 10, "original_pos2": 11,
               "new_token_ids": tiny.encode("Q")}], tick=5)
    assert sm.mirror.live_texts()[10] == "Q"

    def background(tick):
        brain.tick = tick
        snapshot = take_snapshot(brain, tiny)
        styles = styles_by_row(render_context(snapshot, 96, 30), snapshot.texts)
        return [row for row, style in styles.items() if style.bgcolor and style.bgcolor.name == REPAIR_BG]

    assert background(5) == [10]
    assert background(5 + REPAIR_HIGHLIGHT_TICKS - 1) == [10]
    assert background(5 + REPAIR_HIGHLIGHT_TICKS) == []


def test_a_long_context_follows_the_end_and_counts_what_is_hidden(tiny, crafted, lighthouse):
    brain = crafted(tiny, text=lighthouse * 3)
    snapshot = take_snapshot(brain, tiny)
    text = render_context(snapshot, 20, 5)
    lines = text.plain.split("\n")
    assert len(lines) == 5
    hidden = int(re.fullmatch(r"… (\d+) earlier tokens hidden", lines[0]).group(1))
    assert "".join(lines[1:]) == "".join(snapshot.texts[hidden:]), "exactly the tokens after the hidden ones"
    assert lines[-1].endswith(snapshot.texts[-1]), "the newest token is on screen"
    # a context that fits has no hidden line
    assert "hidden" not in render_context(snapshot, 96, 30).plain


def test_newlines_break_lines_and_stay_visible(tiny, crafted):
    brain = crafted(tiny, text="first line\nsecond line" + " pad" * 10)
    lines = render_context(take_snapshot(brain, tiny), 96, 30).plain.split("\n")
    assert lines[0] == "<s>first line↵" and lines[1].startswith("second line")


def test_header_names_the_model_and_the_counters(tiny, crafted, plain):
    brain = crafted(tiny)
    brain.tick = 7
    brain.counts.update(repairs=3, culls=2, rebuilds=1)
    snapshot = take_snapshot(brain, tiny, done=7, total=20, tok_s=12.5)
    out = plain(render_header(snapshot))
    for field in ("random:tiny", "cpu", "tick 7/20", "tok/s 12.5", f"live {len(brain.state)}/48", "culls 2",
                  "repairs 3", "rebuilds 1", f"cache {brain.state.cache.memory_usage_mb():.1f} MiB"):
        assert field in out, field
    assert "brain tick" not in out
    brain.tick = 107  # a resumed run: the brain's own tick differs from this run's count
    assert "brain tick 107" in plain(render_header(take_snapshot(brain, tiny, done=7, total=20)))


def test_histogram_puts_rows_in_their_bins(tiny, crafted, set_brightness):
    brain = crafted(tiny)
    n = len(brain.state)
    set_brightness(brain, [0.0] * (n - 10) + [255.0] * 10)  # most rows dark, ten bright
    text = render_histogram(take_snapshot(brain, tiny), 10, 5)
    bars = text.plain.split("\n")
    assert bars[0][0] == "█" and bars[0][-1] == " ", "the dark bin is the tallest"
    assert bars[2][-1] != " " and all(c == " " for c in bars[2][1:-1]), "only the two end bins are filled"
    assert bars[3] == "0──────255", "an axis from 0 to the scale's top under the bars"
    mean = round(255 * 10 / n)
    assert bars[-1] == f"0/{mean}/255", "min/mean/max, compact in 10 columns"
    wide = render_histogram(take_snapshot(brain, tiny), 30, 5).plain.split("\n")
    assert wide[-1] == f"min 0 mean {mean} max 255"


def test_a_policy_that_does_not_score_brightness_says_so_in_the_histogram(tiny, crafted):
    brain = crafted(tiny, policy="streaming")
    out = render_histogram(take_snapshot(brain, tiny), 20, 5).plain
    assert "not scored: policy streaming" in out and "min 255" not in out


@pytest.mark.parametrize("width,height", [(100, 40), (120, 30), (80, 16)])
def test_a_frame_fills_the_screen_exactly(tiny, width, height, console, crafted, lighthouse):
    snapshot = take_snapshot(crafted(tiny, text=lighthouse * 6), tiny, done=3, total=10)
    c = console(width, height)
    lines = c.render_lines(frame(snapshot, width, height), c.options)
    assert len(lines) == height and all(sum(len(s.text) for s in line) == width for line in lines)


@pytest.fixture
def with_user_turn(crafted, lighthouse):
    def with_user_turn(lm, line="hello"):
        brain = crafted(lm, text=lighthouse, window=8)
        turn = brain.say(line)
        for _ in turn:
            brain.step()
        return brain, turn
    return with_user_turn


def test_typed_tokens_are_marked_in_the_context_and_the_legend_says_so(tiny, with_user_turn):
    brain, turn = with_user_turn(tiny)
    snapshot = take_snapshot(brain, tiny)
    n = len(snapshot.texts)
    text = render_context(snapshot, 400, 30)
    user_rows = [row for row, source in enumerate(snapshot.sources) if source == "user"]
    assert len(user_rows) == len(turn) and user_rows == list(range(n - len(turn), n))
    backgrounds = {span.style.bgcolor.name for span in text.spans if span.style.bgcolor}
    assert USER_BG in backgrounds
    user_chars = "".join(text.plain[span.start:span.end] for span in text.spans
                         if span.style.bgcolor and span.style.bgcolor.name == USER_BG)
    assert user_chars.replace("↵", "") == "".join(snapshot.texts[r] for r in user_rows).replace("\n", ""), \
        "every typed token, and only those, on the user background"
    assert "user" in legend(snapshot).plain
    assert any(s.style.bgcolor and s.style.bgcolor.name == USER_BG for s in legend(snapshot).spans)


@pytest.mark.parametrize("width,height", [(80, 24), (120, 40)])
def test_a_frame_with_the_input_line_fills_the_screen_and_ends_with_it(tiny, width, height, console, with_user_turn):
    brain, _ = with_user_turn(tiny)
    brain.say("more")
    snapshot = take_snapshot(brain, tiny, done=30, total=100)
    c = console(width, height)
    lines = c.render_lines(frame(snapshot, width, height, prompt="what is the time"), c.options)
    assert len(lines) == height and all(sum(len(s.text) for s in line) == width for line in lines)
    last = "".join(s.text for s in lines[-1])
    assert last.startswith("> what is the time ") and last.rstrip().endswith("feeding 22 typed tokens")
    above = "".join(s.text for s in lines[-2])
    assert "30/100" in above, "the progress bar stays just above"
    without = c.render_lines(frame(snapshot, width, height), c.options)
    assert len(without) == height and not "".join(s.text for s in without[-1]).startswith(">")


def test_the_input_line_shows_the_end_of_a_long_line_a_hint_and_why_a_line_was_refused(tiny, crafted, plain):
    snapshot = take_snapshot(crafted(tiny), tiny)
    assert plain(render_input(snapshot, "", 80), 80).rstrip() == "> " + " " * (80 - 3 - len(INPUT_HINT)) + " " + INPUT_HINT
    out = plain(render_input(snapshot, "x" * 100 + "END", 80), 80).rstrip("\n")
    assert out.startswith("> x") and out.rstrip().endswith("END") and len(out) == 80
    refused = take_snapshot(crafted(tiny), tiny, input_note="input refused: the line is 300 tokens as a user turn")
    out = plain(render_input(refused, "abc", 80), 80).rstrip("\n")
    assert out.startswith("> abc") and "input refused: the line is 300 tokens" in out and len(out) <= 80
    out = plain(render_input(refused, "y" * 200, 40), 40).rstrip("\n")
    assert out.startswith("> y") and "input re" in out and out.endswith("…") and len(out) == 40


def test_rows_recall_brought_back_are_green_pinned_rows_italic_and_the_restore_is_said_in_words(tiny, styles_by_row, lighthouse):
    """A real recall run: the restored rows are drawn on the recall background, the edits
    panel names the restore with the text that came back, the legend explains both marks."""
    # tokens that decode to control characters are banned (logit_bias): the view draws those as "·"
    # (and \x1c-\x1e break lines), while styles_by_row reads the rows' texts on one line as they are
    control = ",".join(f"{t}:-100" for t in range(tiny.vocab_size)
                       if any(ord(c) < 32 or ord(c) == 127 for c in tiny.decode([t])))
    config = BrainConfig(budget=40, window=8, seed=1, recall=True, logit_bias=control)
    brain = Brain.start(tiny, [tiny.bos_id] + tiny.encode(lighthouse), config, pins=["lighthouse"])
    brain.policy.recall.threshold = 1.0  # a random model attends about evenly: make recall fire
    recorder = ActionRecorder(tiny)
    brain.observers.append(recorder)
    for _ in range(40):
        brain.step()
    snapshot = take_snapshot(brain, tiny, actions=list(recorder.lines))
    entries = brain.state.mirror.ledger.entries
    live = [entries[i] for i in brain.state.mirror.live.ledger_ids]
    back = [row for row, e in enumerate(live) if e.resurrections]
    assert back, "recall brought rows back in 40 ticks"
    assert snapshot.recalled == [e.resurrections > 0 for e in live] and sum(snapshot.pinned) == len("lighthouse")
    context = render_context(snapshot, 10_000, 1)
    styles = styles_by_row(context, snapshot.texts)
    assert {styles[row].bgcolor.name for row in back if row in styles and row != len(live) - 1} == {RECALL_BG}
    pinned = [row for row, p in enumerate(snapshot.pinned) if p]
    assert all(styles[row].italic for row in pinned if row in styles)
    assert not any(styles[row].italic for row in styles if row not in pinned)
    said = [line for line in recorder.lines if " recall " in line]
    assert said and all(re.match(r"t\d+ recall \d+ rows? ", line) for line in said)
    assert "recalled" in legend(snapshot).plain and "pinned" in legend(snapshot).plain


@pytest.mark.parametrize("prompt", [None, ""])
def test_at_80x24_every_panel_is_there_and_nothing_in_the_header_is_cut(tiny, prompt, crafted, plain):
    brain = crafted(tiny)
    snapshot = take_snapshot(brain, tiny, done=12, total=300, tok_s=123.4, actions=["t3 delete 5 'x'"])
    out = plain(frame(snapshot, 80, 23, prompt), 80, 24)
    lines = out.splitlines()
    assert len(lines) <= 23 + 1
    assert "brightness" in out and "last edits" in out and "t3 delete 5" in out, "the bottom panels stay"
    assert "…" not in lines[0] + lines[1], "the header takes its compact form instead of being cut"
    assert "random:tiny" in lines[0] and "[running]" in lines[0] and "12/300" in lines[1] and "MiB" in lines[1]
    wide = plain(frame(snapshot, 200, 40, prompt), 200, 40).splitlines()
    assert "Positronic Brain" in wide[0] and "policy brightness/ttl" in wide[0] and "culls" in wide[1]


# A terminal's background and its default text colour: black and a VS Code-like dark grey
# (the dark themes), white (the light ones).
TERMINALS = {"black": ((0, 0, 0), (255, 255, 255)), "dark-grey": ((0x1e, 0x1e, 0x1e), (0xd4, 0xd4, 0xd4)),
             "white": ((255, 255, 255), (0, 0, 0))}


def drawn_on(style, terminal) -> tuple[tuple, tuple]:
    """(text colour, background) a style shows on `terminal`: the terminal's own where the
    style sets none, swapped by reverse video."""
    background, foreground = TERMINALS[terminal]
    fg = tuple(style.color.triplet) if style.color else foreground
    bg = tuple(style.bgcolor.triplet) if style.bgcolor else background
    return (bg, fg) if style.reverse else (fg, bg)


@pytest.mark.parametrize("terminal", list(TERMINALS))
def test_every_colour_of_the_context_panel_reads_at_4_5_to_1_on_dark_and_light_terminals(tiny, terminal, console, crafted, set_brightness, lighthouse):
    """WCAG 2 AA (4.5:1) for everything the context panel can draw: a token at every
    brightness level with every combination of marks, and the panel's own text (border,
    title, legend, the hidden-tokens note), each against what it is drawn on."""
    ratios = []
    for lvl in range(LEVELS):
        for marks in itertools.product((False, True), repeat=7):
            style = token_style(lvl, **dict(zip(("sink", "protected", "fresh", "newest", "user", "recalled", "pinned"),
                                                marks)))
            assert not style.dim, "terminals halve a dim colour's lightness"
            ratios.append((contrast(*drawn_on(style, terminal)), lvl, marks))
    brain = crafted(tiny, text=lighthouse * 6)
    n = len(brain.state)
    set_brightness(brain, [255 * i / (n - 1) for i in range(n)])
    panel = frame(take_snapshot(brain, tiny), 80, 12).renderables[1]
    c = console(80, 12)
    drawn = "".join(segment.text for line in c.render_lines(panel, c.options.update(height=None)) for segment in line)
    assert "earlier tokens hidden" in drawn and "context" in drawn and "newest  0..255" in drawn
    for line in c.render_lines(panel, c.options.update(height=None)):
        for segment in line:
            if segment.text.strip():
                assert not segment.style.dim, segment.text
                ratios.append((contrast(*drawn_on(segment.style, terminal)), segment.text, ()))
    assert min(ratios)[0] >= 4.5, min(ratios)


def test_the_legend_names_every_mark_the_newest_token_included(tiny, crafted):
    text = legend(take_snapshot(crafted(tiny), tiny)).plain
    for mark in ("dim", "bright", "sink", "protected", "repaired", "user", "recalled", "pinned", "newest"):
        assert f"{mark} " in text + " ", mark
