"""The terminal side: line editing and key splitting (pure), the key reader on a real pty,
and typing into the live view of a real run on a terminal of its own."""

import threading

import pytest

from positronic.tui.terminal import KeyReader, edit_line, split_keys


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


@pytest.mark.long
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
