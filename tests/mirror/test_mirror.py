"""The mirror on its own (positronic/mirror/mirror.py): splices and invariants; its files are
tests/mirror/test_storage.py."""

import pytest

from positronic import mirror
from positronic.mirror import Insertion, Mirror, MirrorInvariantError, plan_layout


def splice(m, deleted, insertions, texts, tick, brightness=255.0):
    return m.splice(plan_layout(m.positions(), deleted, insertions, limit=10), texts, tick=tick, brightness=brightness)


def test_splices_keep_ledger_and_live_map_in_step(built):
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
def test_check_finds_each_kind_of_inconsistency(corrupt, message, built):
    m = built()
    corrupt(m)
    with pytest.raises(MirrorInvariantError, match=message):
        m.check(max_position=10)


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
def test_a_failure_inside_a_splice_leaves_the_mirror_as_it_was(monkeypatch, target, name, call, built):
    m = built()
    before = mirror.storage.to_columns(m)
    monkeypatch.setattr(target, name, _fail_on_call(call, getattr(target, name)))
    layout = plan_layout(m.positions(), [1, 2], [Insertion(1, (50, 51), "repair", replaces=(1, 2)),
                                                  Insertion(5, (52,), "generated")], limit=10)
    with pytest.raises(RuntimeError, match="disk on fire"):
        m.splice(layout, ["a", "b", "c"], tick=6, brightness=255.0, live_brightness=[9.0] * 5)
    assert mirror.storage.to_columns(m) == before
    m.check(max_position=10)
