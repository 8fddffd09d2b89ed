"""The mirror's files (positronic/mirror/storage.py): msgpack save and load that round-trip
exactly, replace atomically, and refuse damaged, foreign or inconsistent files with one clear error."""

import hashlib
import os
import re

import pytest

from positronic import mirror
from positronic.mirror import Mirror, MirrorFileError


def test_save_and_load_round_trip_exactly(tmp_path, built):
    m = built()
    path = tmp_path / "mirror.msgpack"
    mirror.save(path, m, meta={"tick": 5, "model": "smollm2"})
    loaded, meta = mirror.load(path)
    assert meta == {"tick": 5, "model": "smollm2"}
    assert loaded.ledger.entries == m.ledger.entries
    assert loaded.live.ledger_ids == m.live.ledger_ids and loaded.live.positions == m.live.positions
    assert mirror.to_bytes(loaded, meta) == path.read_bytes()
    assert list(tmp_path.iterdir()) == [path], "no temporary file left behind"


@pytest.mark.parametrize("body_bytes", [0, 200, 70_000, 5_000_000])
def test_the_file_written_in_pieces_is_the_envelope_msgpack_packs(tmp_path, built, body_bytes):
    """to_chunks writes the body as packed, after a head built by hand: joined, the pieces are
    byte for byte what msgpack packs for the whole envelope, for bodies in each of msgpack's
    bin sizes (bin8, bin16, bin32), and the file loads back."""
    m = built()
    meta = {"blob": b"x" * body_bytes}
    head, body = mirror.to_chunks(m, meta)
    envelope = {"format": mirror.storage.FORMAT, "version": mirror.storage.VERSION,
                "sha256": hashlib.sha256(body).hexdigest(), "body": body}
    assert head + body == mirror.storage.msgpack.packb(envelope, use_bin_type=True)
    path = tmp_path / "mirror.msgpack"
    mirror.save(path, m, meta)
    assert path.read_bytes() == head + body == mirror.to_bytes(m, meta)
    assert mirror.load(path)[1] == meta


def test_save_replaces_atomically_and_a_failed_save_keeps_the_old_file(tmp_path, monkeypatch, built):
    path = tmp_path / "mirror.msgpack"
    mirror.save(path, built(), meta={"n": 1})
    good = path.read_bytes()
    monkeypatch.setattr(mirror.storage.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        mirror.save(path, Mirror(), meta={"n": 2})
    assert path.read_bytes() == good and list(tmp_path.iterdir()) == [path]


def resealed(edit):
    """Damage inside the body, with the checksum recomputed (as a careful forger would), so
    the checks behind the checksum are reached."""
    def damage(data: bytes) -> bytes:
        doc = mirror.storage.msgpack.unpackb(data)
        doc["body"] = edit(doc["body"])
        doc["sha256"] = hashlib.sha256(doc["body"]).hexdigest()
        return mirror.storage.msgpack.packb(doc, use_bin_type=True)
    return damage


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[: len(b) // 2], "not a readable mirror file"),
    (lambda b: b"", "not a readable mirror file"),
    (lambda b: b"\xc1" + b[1:], "not a readable mirror file"),
    (lambda b: mirror.storage.msgpack.packb({"format": "something else"}), "not a positronic mirror file"),
    (lambda b: mirror.storage.msgpack.packb([1, 2, 3]), "not a positronic mirror file"),
    (lambda b: b.replace(b"\xa7version\x02", b"\xa7version\x07"), "version 7"),
    # any change of the content: a text, a token id, one flipped bit of the meta
    (lambda b: b.replace(b"\xa5 huge", b"\xa5 HUGE"), "checksum mismatch"),
    (lambda b: b.replace(b"\xa6prompt", b"\xa6pr0mpt"), "checksum mismatch"),
    (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "checksum mismatch|not a readable"),
    (resealed(lambda b: b.replace(b"\xa5 huge", b"\xa5 HUGE").replace(b"\xa5state", b"\xa5stat_")),
     "column 'state' missing"),
    (resealed(lambda b: b.replace(b"\xa6prompt", b"\xa6pr0mpt")), r"ledger source\[0\] = 'pr0mpt'"),
    (resealed(lambda b: b"\x93\x01\x02\x03"), "the mirror body is not a map"),
])
def test_damaged_file_gives_one_clear_error_and_nothing_else(tmp_path, damage, message, built):
    path = tmp_path / "mirror.msgpack"
    mirror.save(path, built())
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(MirrorFileError, match=message) as info:
        mirror.load(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_version_1_files_without_a_checksum_are_still_read(tmp_path, built):
    m = built()
    columns = mirror.storage.to_columns(m)
    path = tmp_path / "old.msgpack"
    path.write_bytes(mirror.storage.msgpack.packb({"format": "positronic-mirror", "version": 1, **columns,
                                                   "meta": {"tick": 3}}, use_bin_type=True))
    loaded, meta = mirror.load(path)
    assert meta == {"tick": 3} and loaded.ledger.entries == m.ledger.entries


def test_file_that_parses_but_is_inconsistent_is_refused(tmp_path, built):
    m = built()
    m.live.positions[1] = 0  # decreasing positions
    path = tmp_path / "bad.msgpack"
    path.write_bytes(mirror.to_bytes(m))
    with pytest.raises(MirrorFileError, match="inconsistent mirror: RoPE positions not strictly increasing"):
        mirror.load(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(MirrorFileError, match="cannot read"):
        mirror.load(tmp_path / "nope.msgpack")


def test_a_write_killed_before_its_rename_leaves_the_old_file_and_a_temporary_stale_temporaries_finds(
        tmp_path, monkeypatch):
    path = tmp_path / "session.msgpack"
    mirror.write_atomic(path, b"old")
    assert mirror.stale_temporaries(path) == []
    monkeypatch.setattr(mirror.storage.Path, "unlink", lambda self, missing_ok=False: None)  # the kill: no clean-up
    monkeypatch.setattr(mirror.storage.os, "replace", lambda src, dst: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        mirror.write_atomic(path, b"new")
    assert path.read_bytes() == b"old"
    stale = mirror.stale_temporaries(path)
    assert len(stale) == 1 and stale[0].read_bytes() == b"new" and stale[0].name.startswith("session.msgpack.")
    assert mirror.stale_temporaries(tmp_path / "other.msgpack") == [], "only the temporaries of that file"


def test_bounded_reads_follow_what_is_opened(tmp_path):
    from positronic.mirror import TooLarge, read_bounded

    small = tmp_path / "small"
    small.write_bytes(b"x" * 10)
    assert read_bounded(small, 10) == b"x" * 10
    with pytest.raises(TooLarge, match="10 bytes, more than the 9 read"):
        read_bounded(small, 9)
    link = tmp_path / "zero"
    link.symlink_to("/dev/zero")  # st_size 0 on the device: a size check alone passes it
    with pytest.raises(OSError, match="not a regular file"):
        read_bounded(link, 1 << 20)
    with pytest.raises(TooLarge, match="more than the 4096 bytes read"):
        read_bounded(link, 4096, regular=False)  # a pipe or device may be read, never without bound
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):  # opened at once, not waiting for a writer
        read_bounded(fifo, 10)


def test_a_failed_atomic_write_names_its_file(tmp_path):
    with pytest.raises(OSError, match=f"cannot write {tmp_path}/missing/file: No such file or directory"):
        mirror.write_atomic(tmp_path / "missing" / "file", b"data")


def test_regular_file_names_what_is_there_without_opening_it(tmp_path):
    """What a command reads whole (a session's mirror.msgpack, an event log a resume appends to,
    a fixture, saved labels) is checked first: a FIFO, a directory or a device is named as such
    (it was reported "missing", or opening a FIFO waited for a writer forever), and a FIFO is
    never opened to find out."""
    from positronic.mirror.storage import regular_file

    plain = tmp_path / "plain"
    plain.write_bytes(b"x" * 3)
    assert regular_file(plain).st_size == 3
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "zero"
    link.symlink_to("/dev/zero")  # links are followed: what would be opened is checked
    for path, kind in ((fifo, "a FIFO"), (tmp_path, "a directory"), (link, "a character device")):
        with pytest.raises(OSError, match=re.escape(f"not a regular file ({kind})")):
            regular_file(path)
    with pytest.raises(FileNotFoundError):
        regular_file(tmp_path / "missing")
