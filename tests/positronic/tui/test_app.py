"""The live terminal view: frames rendered from crafted real states, and short real runs.

States are real (random:tiny, a byte-level tokenizer: one character per token, BOS is
'<s>'), brightness is set by hand, frames go through rich's recording console.
"""

import io
import itertools
import re
import threading

import pytest
from rich.console import Console
from rich.live import _RefreshThread

from positronic import StateManager
from positronic.brain.loop import Brain, BrainConfig
from positronic.brain.runner import Runner
from positronic.tui.app import (CONTRAST_FLOOR_AT, INPUT_HINT, LEVELS, PANEL_BG, RECALL_BG, REPAIR_BG, REPAIR_HIGHLIGHT_TICKS, SINK_BG, USER_BG,
                            VIRIDIS, ActionRecorder, contrast, viridis,
                            KeyReader, edit_line, frame, legend, render_actions, render_context, render_header,
                            loading, render_histogram, render_input, run_live, split_keys, take_snapshot, token_style)

TEXT = "The old lighthouse keeper climbed the spiral stairs every night"  # 63 tokens + BOS


def console(width=100, height=40) -> Console:
    return Console(record=True, width=width, height=height, force_terminal=True, color_system="truecolor",
                   file=io.StringIO())


def crafted(lm, text=TEXT, **config) -> Brain:
    """A real brain over `text` (no ticks run)."""
    state = StateManager.from_tokens(lm, [lm.bos_id] + lm.encode(text))
    return Brain(state, BrainConfig(**{"budget": 48, "repairer": "self", **config}))


def set_brightness(brain: Brain, values: list[float]) -> None:
    """Store brightness the only way there is: as Step 4's argument, here with no edits."""
    report = brain.state.apply([], tick=brain.tick, brightness=values)
    assert not report.rebuilt, report.error
    assert brain.state.mirror.brightness() == values


def styles_by_row(text, texts) -> dict:
    """The style each row's first character is drawn with, in a context rendered on one
    line (so row r starts at the summed length of the rows before it)."""
    assert "\n" not in text.plain and text.plain == "".join(texts)
    styles, offset = {}, 0
    for row, t in enumerate(texts):
        if t:
            styles[row] = next(s.style for s in text.spans if s.start <= offset < s.end)
        offset += len(t)
    return styles


def luminance(rgb) -> float:
    r, g, b = rgb
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def plain(renderable, width=100, height=40) -> str:
    c = console(width, height)
    c.print(renderable)
    return c.export_text()


def test_colour_runs_from_the_dim_end_to_the_bright_end_monotonically(tiny):
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


def test_colour_scale_is_the_rules_range(tiny):
    """vote brightness runs to 10000: 50 is at the dim end there, 5000 half way, 10000 the bright end."""
    brain = crafted(tiny, brightness="vote")
    n = len(brain.state)
    set_brightness(brain, [50.0] * 20 + [5000.0] * (n - 21) + [10000.0])
    snapshot = take_snapshot(brain, tiny)
    styles = styles_by_row(render_context(snapshot, 96, 30), snapshot.texts)
    assert tuple(styles[10].color.triplet) == viridis(CONTRAST_FLOOR_AT)
    assert luminance(viridis(CONTRAST_FLOOR_AT)) < luminance(styles[30].color.triplet) < luminance(VIRIDIS[-1])
    assert tuple(styles[n - 1].color.triplet) == VIRIDIS[-1]


def test_sinks_and_protected_rows_are_marked(tiny):
    brain = crafted(tiny, sinks=4, protect=6, window=8)
    n = len(brain.state)
    snapshot = take_snapshot(brain, tiny)
    styles = styles_by_row(render_context(snapshot, 96, 30), snapshot.texts)
    for row, style in styles.items():
        assert (str(style.bgcolor.name) if style.bgcolor else None) == (SINK_BG if row < 4 else PANEL_BG), row
        assert bool(style.underline) == (row < 6 or row >= n - 8), row
    assert styles[n - 1].reverse, "the newest token stands out"
    assert not styles[n - 2].reverse


def test_repaired_tokens_are_highlighted_for_a_few_ticks(tiny):
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


def test_a_long_context_follows_the_end_and_counts_what_is_hidden(tiny):
    brain = crafted(tiny, text=TEXT * 3)
    snapshot = take_snapshot(brain, tiny)
    text = render_context(snapshot, 20, 5)
    lines = text.plain.split("\n")
    assert len(lines) == 5
    hidden = int(re.fullmatch(r"… (\d+) earlier tokens hidden", lines[0]).group(1))
    assert "".join(lines[1:]) == "".join(snapshot.texts[hidden:]), "exactly the tokens after the hidden ones"
    assert lines[-1].endswith(snapshot.texts[-1]), "the newest token is on screen"
    # a context that fits has no hidden line
    assert "hidden" not in render_context(snapshot, 96, 30).plain


def test_newlines_break_lines_and_stay_visible(tiny):
    brain = crafted(tiny, text="first line\nsecond line" + " pad" * 10)
    lines = render_context(take_snapshot(brain, tiny), 96, 30).plain.split("\n")
    assert lines[0] == "<s>first line↵" and lines[1].startswith("second line")


def test_header_names_the_model_and_the_counters(tiny):
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


def test_edits_are_described_in_words_with_the_texts_before_the_edits(tiny):
    brain = crafted(tiny)  # rows: '<s>', 'T', 'h', 'e', ' ', 'o', 'l', 'd', ' ', 'l', 'i', 'g', 'h', ...
    recorder = ActionRecorder(tiny)
    brain.observers.append(recorder)
    brain.tick = 9
    actions = [{"action": "replace_pair", "original_pos1": 5, "original_pos2": 6, "new_token_ids": tiny.encode("XY")},
               {"action": "delete", "position": 9}, {"action": "add", "token_id": tiny.encode("!")[0]}]
    for observer in brain.observers:  # what Brain.step does around Step 4
        observer.before_apply(brain, actions)
    report = brain.state.apply(actions, tick=brain.tick)
    for observer in brain.observers:
        observer.after_apply(brain, actions, report)
    assert list(recorder.lines) == ["t9 replace 5–6 'ol' → 'XY'", "t9 delete 9 'l'"]
    out = plain(render_actions(take_snapshot(brain, tiny, actions=list(recorder.lines)), 6))
    assert "replace 5–6 'ol' → 'XY'" in out and "delete 9 'l'" in out


def test_histogram_puts_rows_in_their_bins(tiny):
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


def test_a_policy_that_does_not_score_brightness_says_so_in_the_histogram(tiny):
    brain = crafted(tiny, policy="streaming")
    out = render_histogram(take_snapshot(brain, tiny), 20, 5).plain
    assert "not scored: policy streaming" in out and "min 255" not in out


@pytest.mark.parametrize("width,height", [(100, 40), (120, 30), (80, 16)])
def test_a_frame_fills_the_screen_exactly(tiny, width, height):
    snapshot = take_snapshot(crafted(tiny, text=TEXT * 6), tiny, done=3, total=10)
    c = console(width, height)
    lines = c.render_lines(frame(snapshot, width, height), c.options)
    assert len(lines) == height and all(sum(len(s.text) for s in line) == width for line in lines)


def test_a_snapshot_does_not_change_with_the_brain(tiny):
    """The render thread reads snapshots while the loop edits the mirror: they must be copies."""
    brain = crafted(tiny)
    snapshot = take_snapshot(brain, tiny)
    texts, brightness, counts = list(snapshot.texts), list(snapshot.brightness), dict(snapshot.counts)
    set_brightness(brain, [1.0] * len(brain.state))
    brain.state.apply([{"action": "delete", "position": 10}, {"action": "add", "token_id": 50}])
    brain.counts["culls"] += 1
    assert snapshot.texts == texts and snapshot.brightness == brightness and snapshot.counts == counts


def live_stopped() -> bool:
    """No rich refresh thread is left running (Live.stop signals it; it ends at once)."""
    threads = [t for t in threading.enumerate() if isinstance(t, _RefreshThread)]
    for thread in threads:
        thread.join(timeout=2)
    return not any(t.is_alive() for t in threads)


def live_run(tiny, ticks, *observers, text=TEXT):
    brain = Brain.start(tiny, [tiny.bos_id] + tiny.encode(text), BrainConfig(budget=48, seed=1))
    brain.observers.extend(observers)
    c = console(100, 30)
    result = run_live(brain, tiny, Runner(brain, tiny.name, ticks), show_prompt=True, console=c)
    return brain, result, c.export_text()


def test_run_live_runs_shows_frames_and_ends_with_the_summary(tiny):
    brain, result, out = live_run(tiny, 20)
    assert result.ticks == 20 and not result.interrupted
    assert "[finished]" in out and "tick 20/20" in out and "replace" in out  # 64 tokens > 48: repairs ran
    assert out.rindex("--- summary ---") > out.rindex("[finished]"), "the summary follows the last frame"
    assert "ticks 20 in" in out
    assert brain.observers == [], "the action recorder is removed"
    assert live_stopped(), "Live stopped"


class CtrlC:
    """An observer that presses Ctrl-C at a given tick (what the user does)."""

    def __init__(self, tick):
        self.tick = tick

    def before_apply(self, brain, actions, brightness=None):
        if brain.tick == self.tick:
            raise KeyboardInterrupt

    def after_apply(self, brain, actions, report):
        pass


def test_ctrl_c_ends_the_view_cleanly_with_the_summary(tiny):
    brain, result, out = live_run(tiny, 50, CtrlC(6))
    assert result.interrupted and result.ticks == 5
    assert "[interrupted]" in out and "--- summary --- (interrupted)" in out
    assert live_stopped()


class Fault:
    """An observer that makes Step 4 fail at a given tick (the state manager then rebuilds)."""

    def __init__(self, tick):
        self.tick = tick

    def before_apply(self, brain, actions, brightness=None):
        if brain.tick == self.tick:
            brain.state.inject_fault("forward")

    def after_apply(self, brain, actions, report):
        pass


def test_a_failed_tick_is_logged_and_the_run_goes_on(tiny):
    brain, result, out = live_run(tiny, 6, Fault(4))
    assert result.ticks == 6 and not result.interrupted
    assert brain.counts["rebuilds"] == 1 and "rebuilds 1" in out
    born = [entry.tick_born for entry in brain.state.mirror.ledger.entries]
    assert 4 not in born and {3, 5, 6} <= set(born), "tick 4 added nothing, the others did"
    assert live_stopped()
    # the edits panel's log: what the tick tried, then that it failed
    brain = crafted(tiny)
    recorder = ActionRecorder(tiny)
    brain.observers.extend([recorder, Fault(1)])
    record = brain.step()
    assert record.rebuilt and record.text == ""
    assert len(recorder.lines) >= 2 and recorder.lines[0].startswith("t1 replace ")
    assert recorder.lines[-1].startswith("t1 REBUILT the cache from the mirror: InjectedFault")
    assert "REBUILT" in plain(render_actions(take_snapshot(brain, tiny, actions=list(recorder.lines)), 6))


# --- the input line ---------------------------------------------------------------------


def typed(keys, buffer=""):
    """The line after `keys`, and the lines they submitted."""
    submitted = []
    for key in keys:
        buffer, line = edit_line(buffer, key)
        if line is not None:
            submitted.append(line)
    return buffer, submitted


def test_line_editing_is_a_pure_function_of_the_line_and_the_key():
    assert edit_line("ab", "c") == ("abc", None)
    assert edit_line("abc", "\x7f") == ("ab", None) and edit_line("abc", "\x08") == ("ab", None)
    assert edit_line("", "\x7f") == ("", None)
    assert edit_line("hello", "\r") == ("", "hello") and edit_line("hello", "\n") == ("", "hello")
    assert edit_line("   ", "\r") == ("", None), "a blank line is not submitted"
    assert edit_line("hello", "\x1b") == ("", None), "Esc clears"
    assert edit_line("hello", "\x15") == ("", None), "so does Ctrl-U"
    assert edit_line("a", "\t") == ("a ", None)
    for key in ("\x1b[A", "\x1b[1;5C", "\x1bOP", "\x01", "\x04", "\x00"):  # arrows, F1, control keys
        assert edit_line("abc", key) == ("abc", None), repr(key)
    assert edit_line("caf", "é") == ("café", None) and edit_line("", "語") == ("語", None)
    assert typed("hi yoo\x7fu\rsecond\x1bthird\r") == ("", ["hi you", "third"])
    assert typed("partial") == ("partial", [])


def test_keys_split_with_escape_sequences_whole():
    assert split_keys("ab\r") == ["a", "b", "\r"]
    assert split_keys("\x1b") == ["\x1b"], "a lone Esc is the Esc key"
    assert split_keys("x\x1b[Ay\x1b[1;5Dz\x1bOPw") == ["x", "\x1b[A", "y", "\x1b[1;5D", "z", "\x1bOP", "w"]
    assert split_keys("\x1bx") == ["\x1bx"], "Alt+x is one key (ignored by the line)"
    assert typed(split_keys("ab\x1b[Dc\r")) == ("", ["abc"])


def with_user_turn(lm, line="hello"):
    brain = crafted(lm, text=TEXT, window=8)
    turn = brain.say(line)
    for _ in turn:
        brain.step()
    return brain, turn


def test_typed_tokens_are_marked_in_the_context_and_the_legend_says_so(tiny):
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
def test_a_frame_with_the_input_line_fills_the_screen_and_ends_with_it(tiny, width, height):
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


def test_the_input_line_shows_the_end_of_a_long_line_a_hint_and_why_a_line_was_refused(tiny):
    snapshot = take_snapshot(crafted(tiny), tiny)
    assert plain(render_input(snapshot, "", 80), 80).rstrip() == "> " + " " * (80 - 3 - len(INPUT_HINT)) + " " + INPUT_HINT
    out = plain(render_input(snapshot, "x" * 100 + "END", 80), 80).rstrip("\n")
    assert out.startswith("> x") and out.rstrip().endswith("END") and len(out) == 80
    refused = take_snapshot(crafted(tiny), tiny, input_note="input refused: the line is 300 tokens as a user turn")
    out = plain(render_input(refused, "abc", 80), 80).rstrip("\n")
    assert out.startswith("> abc") and "input refused: the line is 300 tokens" in out and len(out) <= 80
    out = plain(render_input(refused, "y" * 200, 40), 40).rstrip("\n")
    assert out.startswith("> y") and "input re" in out and out.endswith("…") and len(out) == 40


def test_lines_typed_into_a_live_run_are_fed_and_a_refused_one_is_said_in_the_view(tiny, capsys):
    import queue

    # no culls in 30 ticks: the refusal is the edits panel's only line
    brain = Brain.start(tiny, [tiny.bos_id] + tiny.encode(TEXT), BrainConfig(budget=128, window=8, seed=1))
    inputs = queue.SimpleQueue()
    for line in ("hello", "z" * 100):
        inputs.put(line)
    c = console(100, 30)
    result = run_live(brain, tiny, Runner(brain, tiny.name, 30, inputs=inputs), show_prompt=True, console=c)
    out = c.export_text()
    assert result.ticks == 30
    sources = [e.source for e in brain.state.mirror.ledger.entries]
    typed_ids = [e.token_id for e in brain.state.mirror.ledger.entries if e.source == "user"]
    assert tiny.decode(typed_ids) == "\nUser: hello\nAssistant:" and sources[-1] == "generated"
    assert "t0 input refused: the line is 118 tokens" in out, "in the edits panel"
    assert "refused" not in capsys.readouterr().err, "nothing written under the view"
    assert live_stopped()


def pty_available():
    try:
        import pty  # noqa: F401
        import termios  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not pty_available(), reason="needs a POSIX terminal")
def test_the_key_reader_reads_keys_in_cbreak_mode_and_puts_the_terminal_back_however_it_ends():
    import os
    import pty
    import termios
    import time

    master, slave = pty.openpty()
    try:
        before = termios.tcgetattr(slave)
        keys = []
        with KeyReader(slave, keys.append):
            during = termios.tcgetattr(slave)
            assert not during[3] & termios.ICANON and not during[3] & termios.ECHO, "cbreak: no echo, no line buffer"
            assert during[3] & termios.ISIG, "Ctrl-C still sends SIGINT"
            os.write(master, "hé\x1b[A\x7f\r".encode())
            deadline = time.monotonic() + 10
            while len(keys) < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert keys == ["h", "é", "\x1b[A", "\x7f", "\n"], "Enter's CR arrives as LF (ICRNL stays)"
        assert termios.tcgetattr(slave) == before
        with pytest.raises(KeyboardInterrupt):
            with KeyReader(slave, keys.append):
                raise KeyboardInterrupt
        assert termios.tcgetattr(slave) == before, "restored on Ctrl-C and on errors too"
    finally:
        os.close(master)
        os.close(slave)
    read, write = os.pipe()
    with KeyReader(read, keys.append) as reader:  # not a terminal: no keys, no error
        assert not reader.active
    os.close(read)
    os.close(write)


@pytest.mark.skipif(not pty_available(), reason="needs a POSIX terminal")
def test_typing_into_the_live_view_of_a_real_run_and_ctrl_c_on_its_terminal(tiny, tmp_path):
    """run.py on a terminal of its own: a line typed and sent with Enter is fed as a user turn,
    Ctrl-C typed on the terminal still stops the run cleanly (exit 130, session saved), and the
    terminal's settings are as they were before the run."""
    import fcntl
    import json
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios
    import time
    from pathlib import Path

    from positronic.brain import session as sessions

    root = Path(__file__).resolve().parents[3]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    before = termios.tcgetattr(slave)
    events = tmp_path / "events.jsonl"
    process = subprocess.Popen(
        [sys.executable, "run.py", "--model", "random:tiny", "--ticks", "100000", "--session", str(tmp_path / "s"),
         "--save-every", "100000", "--events", str(events)], cwd=root, stdin=slave, stdout=slave, stderr=slave,
        start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # its controlling terminal
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "30"})
    output = bytearray()

    def drain():  # a terminal nobody reads would block the view
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            output.extend(data)

    threading.Thread(target=drain, daemon=True).start()

    def wait_for(condition, seconds=120):
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline and process.poll() is None, bytes(output)[-2000:].decode(errors="replace")
            time.sleep(0.05)

    def typed_ticks():
        lines = events.read_text().splitlines() if events.exists() else []
        return sum(json.loads(line).get("source") == "user" for line in lines[:-1])  # the last may be half written

    try:
        wait_for(lambda: b"loading random:tiny" in output)  # while the model loads, before the view
        wait_for(lambda: b"Positronic Brain" in output and b"> " in output)
        os.write(master, b"hi yoo\x7fu\r")
        wait_for(lambda: typed_ticks() >= 24)  # "\nUser: hi you\nAssistant:"
        os.write(master, b"\x03")  # Ctrl-C, as typed: the terminal sends SIGINT
        assert process.wait(timeout=120) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        after = termios.tcgetattr(slave)
        os.close(master)
        os.close(slave)
    assert after == before, "the terminal is put back"
    assert b"--- summary --- (interrupted)" in output
    brain = sessions.resume(tiny, tmp_path / "s")
    typed_ids = [e.token_id for e in brain.state.mirror.ledger.entries if e.source == "user"]
    assert tiny.decode(typed_ids) == "\nUser: hi you\nAssistant:"


def test_rows_recall_brought_back_are_green_pinned_rows_italic_and_the_restore_is_said_in_words(tiny):
    """A real recall run: the restored rows are drawn on the recall background, the edits
    panel names the restore with the text that came back, the legend explains both marks."""
    brain = Brain.start(tiny, [tiny.bos_id] + tiny.encode(TEXT), BrainConfig(budget=40, window=8, seed=1, recall=True),
                        pins=["lighthouse"])
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
def test_at_80x24_every_panel_is_there_and_nothing_in_the_header_is_cut(tiny, prompt):
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
def test_every_colour_of_the_context_panel_reads_at_4_5_to_1_on_dark_and_light_terminals(tiny, terminal):
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
    brain = crafted(tiny, text=TEXT * 6)
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


def test_the_legend_names_every_mark_the_newest_token_included(tiny):
    text = legend(take_snapshot(crafted(tiny), tiny)).plain
    for mark in ("dim", "bright", "sink", "protected", "repaired", "user", "recalled", "pinned", "newest"):
        assert f"{mark} " in text + " ", mark


def test_a_loading_line_shows_until_the_view_opens_and_ctrl_c_passes_through_it():
    """Ctrl-C while the model loads must reach the CLI (which exits 130) with the line gone."""
    c = console()
    with pytest.raises(KeyboardInterrupt):
        with loading("smollm2", c):
            assert c.is_terminal
            raise KeyboardInterrupt
    assert "loading smollm2 …" in c.export_text()
    assert c._live_stack == [], "the spinner's Live stopped"
