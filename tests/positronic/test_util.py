"""positronic.util: one-line messages, exact ints, the atomic directory write."""

import os

import pytest

from positronic import util


def test_one_line_joins_lines_and_cuts_long_text():
    assert util.one_line("first line\n  second\tline\n") == "first line second line"
    cut = util.one_line("word " * 100, limit=20)
    assert len(cut) == 20 and cut.endswith("…") and "\n" not in cut
    assert util.error_line(OSError("disk\nfull")) == "OSError: disk full"


def test_is_int_refuses_bools_floats_and_lists_of_them():
    assert util.is_int(3) and util.is_int(-2**70)
    assert not any(util.is_int(v) for v in (True, 3.0, "3", None))
    assert util.is_int_list([]) and util.is_int_list([1, 2])
    assert not util.is_int_list([1, True]) and not util.is_int_list((1, 2)) and not util.is_int_list([1.0])


def test_atomic_write_dir(tmp_path):
    target = tmp_path / "cache" / "thing"

    def broken(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("interrupted")
    with pytest.raises(RuntimeError):
        util.atomic_write_dir(target, broken)
    assert not target.exists() and not target.parent.exists(), "nothing left, not even the parent it made"

    util.atomic_write_dir(target, lambda tmp: (tmp / "a").write_text("old"))
    util.atomic_write_dir(target, lambda tmp: (tmp / "b").write_text("new"))
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert [p.name for p in target.parent.iterdir()] == ["thing"]  # no temp dirs left

    with pytest.raises(RuntimeError):  # a failed replacement keeps the complete one and its parent
        util.atomic_write_dir(target, broken)
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert [p.name for p in target.parent.iterdir()] == ["thing"]


def test_atomic_write_dir_syncs_every_file_before_the_rename(tmp_path, monkeypatch):
    """A directory renamed into place must not hold data still only in the page cache: each
    file (and the parent, for the rename) is fsynced first."""
    synced, real = [], os.fsync
    monkeypatch.setattr(util.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    target = tmp_path / "thing"

    def write(tmp):
        (tmp / "a").write_text("1")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b").write_text("2")
    util.atomic_write_dir(target, write)
    names = [os.path.basename(path) for path in synced]
    assert {"a", "b"} <= set(names) and synced[-1] == str(tmp_path)
    assert (target / "sub" / "b").read_text() == "2"


def test_quiet_transformers_restores_the_verbosity():
    import transformers

    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_info()
    try:
        with util.quiet_transformers():
            assert transformers.logging.get_verbosity() == transformers.logging.ERROR
        assert transformers.logging.get_verbosity() == transformers.logging.INFO
    finally:
        transformers.logging.set_verbosity(before)
