"""The mirror on its own: splices, invariants, and msgpack files that round-trip or refuse."""

import hashlib

import pytest

from positronic import mirror
from positronic.mirror import Insertion, Mirror, MirrorFileError, MirrorInvariantError, plan_layout


def splice(m, deleted, insertions, texts, tick, brightness=255.0):
    return m.splice(plan_layout(m.positions(), deleted, insertions, limit=10), texts, tick=tick, brightness=brightness)


def built():
    """A mirror with history: prompt, a cull, a replacement, a generated token."""
    m = Mirror()
    splice(m, [], [Insertion(0, (1, 10, 11, 12, 13), "prompt")], ["<s>", "A", " big", " red", " dog"], tick=0)
    splice(m, [1], [], [], tick=3)
    splice(m, [1, 2], [Insertion(1, (99, 98), "repair", replaces=(1, 2))], [" huge", "!"], tick=4)
    splice(m, [], [Insertion(4, (7,), "generated")], [" ran"], tick=5, brightness=200.5)
    m.set_brightness([1.0, 2.0, 3.0, 4.5, 5.0])
    return m


def test_splices_keep_ledger_and_live_map_in_step():
    m = built()
    m.check(max_position=10)
    assert m.live_token_ids() == [1, 99, 98, 13, 7]
    assert m.positions() == [0, 1, 2, 4, 5]
    assert m.brightness() == [1.0, 2.0, 3.0, 4.5, 5.0]
    assert [e.state for e in m.ledger.entries] == ["live", "culled", "replaced", "replaced", "live", "live", "live", "live"]
    assert m.ledger[2].replaced_by == [5, 6] and m.ledger[1].tick_died == 3


def prompt_mirror():
    """Six prompt tokens at positions 0..5."""
    m = Mirror()
    splice(m, [], [Insertion(0, (1, 10, 11, 12, 13, 14), "prompt")], ["<s>", "A", " big", " red", " dog", "."], tick=0)
    return m


# a tick: cull row 1, replace rows 3-4 by one token, add one token
TICK = dict(deleted=[1, 3, 4], insertions=[Insertion(3, (99,), "repair", replaces=(3, 4)),
                                           Insertion(6, (7,), "generated")])


def test_a_layout_splice_edits_ledger_and_live_map_in_one_step():
    m = prompt_mirror()
    layout = plan_layout(m.positions(), TICK["deleted"], TICK["insertions"], limit=100)
    new_ids = m.splice(layout, [" huge", " ran"], tick=4, brightness=200.0,
                       live_brightness=[10.0, 11.0, 12.0, 13.0, 14.0, 15.0])
    m.check(max_position=100)
    assert new_ids == [6, 7]
    assert m.live_token_ids() == [1, 11, 99, 14, 7]
    assert m.live_texts() == ["<s>", " big", " huge", ".", " ran"]
    assert m.live.ledger_ids == [0, 2, 6, 5, 7]
    assert m.positions() == list(layout.positions) == [0, 2, 3, 5, 6], "survivors keep their positions"
    assert m.brightness() == [10.0, 12.0, 14.0, 15.0, 200.0], "the tick's brightness; a replacement starts at the brightest row it replaces (13, 14), a new token at the start"
    assert [m.ledger[i].brightness for i in (1, 3, 4)] == [11.0, 13.0, 14.0], "the dead keep their last value"
    states = [(e.state, e.tick_died, e.replaced_by) for e in m.ledger.entries]
    assert states[1] == ("culled", 4, [])
    assert states[3] == states[4] == ("replaced", 4, [6])
    assert [(e.source, e.tick_born) for e in m.ledger.entries[6:]] == [("repair", 4), ("generated", 4)]


@pytest.mark.parametrize("spoil, message", [
    (lambda m, layout, texts: (m.splice(plan_layout([0, 1, 2], [], [], 100), [], tick=4, brightness=1.0)),
     "layout planned for 3 rows, the live map has 6"),
    (lambda m, layout, texts: m.splice(layout, texts[:1], tick=4, brightness=1.0), "1 texts for 2 new tokens"),
    (lambda m, layout, texts: m.splice(layout, texts, tick=4, brightness=1.0, live_brightness=[1.0] * 5),
     "5 brightness values for 6 live rows"),
    (lambda m, layout, texts: m.splice(
        plan_layout(m.positions(), [1], [Insertion(6, (7,), "dreamt")], 100), [" x"], tick=4, brightness=1.0),
     "unknown token source 'dreamt'"),
    (lambda m, layout, texts: m.splice(
        plan_layout(m.positions(), [1], [Insertion(3, (9,), "repair", replaces=(3, 4))], 100), [" x"], tick=4,
        brightness=1.0), r"rows \(3, 4\) are replaced but not deleted"),
])
def test_a_refused_layout_splice_changes_nothing(spoil, message):
    m = prompt_mirror()
    layout = plan_layout(m.positions(), TICK["deleted"], TICK["insertions"], limit=100)
    before = mirror.to_bytes(m)
    with pytest.raises(ValueError, match=message):
        spoil(m, layout, [" huge", " ran"])
    assert mirror.to_bytes(m) == before


@pytest.mark.parametrize("corrupt, message", [
    (lambda m: m.live.positions.__setitem__(2, 1), "not strictly increasing at row 2"),
    (lambda m: m.live.positions.__setitem__(4, 10), "beyond the model's limit 10"),
    (lambda m: m.live.ledger_ids.__setitem__(1, 2), "which is replaced"),
    (lambda m: m.live.ledger_ids.__setitem__(1, 0), "appears twice"),
    (lambda m: m.live.ledger_ids.__setitem__(1, 50), "does not exist"),
    (lambda m: setattr(m.ledger[1], "state", "live"), "ledger has 6 live tokens"),
    (lambda m: setattr(m.ledger[1], "tick_died", None), "no tick of death"),
    (lambda m: setattr(m.ledger[2], "replaced_by", []), "names no valid replacement"),
    (lambda m: m.live.positions.pop(), "5 live rows but 4 positions"),
    (lambda m: setattr(m.ledger[0], "brightness", float("nan")), "ledger id 0 has brightness nan"),
    (lambda m: setattr(m.ledger[3], "brightness", float("inf")), "ledger id 3 has brightness inf"),
])
def test_check_finds_each_kind_of_inconsistency(corrupt, message):
    m = built()
    corrupt(m)
    with pytest.raises(MirrorInvariantError, match=message):
        m.check(max_position=10)


def test_save_and_load_round_trip_exactly(tmp_path):
    m = built()
    path = tmp_path / "mirror.msgpack"
    mirror.save(path, m, meta={"tick": 5, "model": "smollm2"})
    loaded, meta = mirror.load(path)
    assert meta == {"tick": 5, "model": "smollm2"}
    assert loaded.ledger.entries == m.ledger.entries
    assert loaded.live.ledger_ids == m.live.ledger_ids and loaded.live.positions == m.live.positions
    assert mirror.to_bytes(loaded, meta) == path.read_bytes()
    assert list(tmp_path.iterdir()) == [path], "no temporary file left behind"


def test_save_replaces_atomically_and_a_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
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
def test_damaged_file_gives_one_clear_error_and_nothing_else(tmp_path, damage, message):
    path = tmp_path / "mirror.msgpack"
    mirror.save(path, built())
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(MirrorFileError, match=message) as info:
        mirror.load(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_version_1_files_without_a_checksum_are_still_read(tmp_path):
    m = built()
    columns = mirror.storage.to_columns(m)
    path = tmp_path / "old.msgpack"
    path.write_bytes(mirror.storage.msgpack.packb({"format": "positronic-mirror", "version": 1, **columns,
                                                   "meta": {"tick": 3}}, use_bin_type=True))
    loaded, meta = mirror.load(path)
    assert meta == {"tick": 3} and loaded.ledger.entries == m.ledger.entries


def test_file_that_parses_but_is_inconsistent_is_refused(tmp_path):
    m = built()
    m.live.positions[1] = 0  # decreasing positions
    path = tmp_path / "bad.msgpack"
    path.write_bytes(mirror.to_bytes(m))
    with pytest.raises(MirrorFileError, match="inconsistent mirror: RoPE positions not strictly increasing"):
        mirror.load(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(MirrorFileError, match="cannot read"):
        mirror.load(tmp_path / "nope.msgpack")


def _fail_on_call(number: int, original):
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            raise RuntimeError("disk on fire")
        return original(*args, **kwargs)
    return failing


@pytest.mark.parametrize("target, name, call", [
    (mirror.ledger.Ledger, "add", 2),               # one replacement token recorded, the second not
    (mirror.ledger.Ledger, "link_replacement", 1),  # rows retired and tokens added, not linked
    (mirror.ledger.Ledger, "retire", 2),            # one row retired, the next not
    (mirror.mirror, "LiveMap", 1),                  # the ledger done, the live map not
])
def test_a_failure_inside_a_splice_leaves_the_mirror_as_it_was(monkeypatch, target, name, call):
    m = built()
    before = mirror.storage.to_columns(m)
    monkeypatch.setattr(target, name, _fail_on_call(call, getattr(target, name)))
    layout = plan_layout(m.positions(), [1, 2], [Insertion(1, (50, 51), "repair", replaces=(1, 2)),
                                                  Insertion(5, (52,), "generated")], limit=10)
    with pytest.raises(RuntimeError, match="disk on fire"):
        m.splice(layout, ["a", "b", "c"], tick=6, brightness=255.0, live_brightness=[9.0] * 5)
    assert mirror.storage.to_columns(m) == before
    m.check(max_position=10)
