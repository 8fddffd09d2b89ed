"""The ledger (positronic/mirror/ledger.py): append-only, every token's life from live to
culled or replaced, and back from culled (recall), refusing any other move."""

import pytest

from positronic.mirror import CULLED, LIVE, REPLACED, Ledger


def ledger_of(count: int) -> Ledger:
    ledger = Ledger()
    for i in range(count):
        assert ledger.add(100 + i, f"t{i}", "prompt", tick=0, brightness=255.0) == i, "ids are row indices"
    return ledger


def test_add_records_a_live_token_and_refuses_an_unknown_source():
    ledger = ledger_of(2)
    entry = ledger[1]
    assert (entry.token_id, entry.text, entry.source, entry.tick_born, entry.state) == (101, "t1", "prompt", 0, LIVE)
    assert entry.tick_died is None and entry.replaced_by == [] and entry.position is None
    with pytest.raises(ValueError, match="unknown token source 'dreamt'"):
        ledger.add(5, "x", "dreamt", tick=1, brightness=1.0)
    assert len(ledger) == 2, "a refused add records nothing"


def test_retire_then_resurrect_comes_back_at_the_recorded_position_and_counts_it():
    ledger = ledger_of(3)
    ledger.retire(1, tick=7, position=12)
    assert (ledger[1].state, ledger[1].tick_died, ledger[1].position) == (CULLED, 7, 12)
    assert ledger.count(LIVE) == 2 and ledger.count(CULLED) == 1
    ledger.resurrect(1, brightness=42.0)
    entry = ledger[1]
    assert (entry.state, entry.tick_died, entry.position, entry.resurrections, entry.brightness) == (LIVE, None, None, 1, 42.0)
    ledger.retire(1, tick=9, position=12)
    ledger.resurrect(1, brightness=1.0)
    assert ledger[1].resurrections == 2


def test_only_live_tokens_retire_and_only_culled_ones_with_a_position_come_back():
    ledger = ledger_of(3)
    with pytest.raises(ValueError, match="ledger id 0 is live.*only a culled token can come back"):
        ledger.resurrect(0, brightness=1.0)
    ledger.retire(0, tick=1)  # no position recorded
    with pytest.raises(ValueError, match="without a position"):
        ledger.resurrect(0, brightness=1.0)
    with pytest.raises(ValueError, match="ledger id 0 is culled, not live"):
        ledger.retire(0, tick=2)
    assert ledger[0].tick_died == 1, "the refused retire left the entry as it was"


def test_link_replacement_turns_culled_tokens_into_replaced_ones_and_refuses_live_ones():
    ledger = ledger_of(4)
    ledger.retire(1, tick=3, position=1)
    ledger.retire(2, tick=3, position=2)
    new = ledger.add(7, "x", "repair", tick=3, brightness=255.0)
    ledger.link_replacement([1, 2], [new])
    assert [(e.state, e.replaced_by) for e in ledger.entries[1:3]] == [(REPLACED, [4]), (REPLACED, [4])]
    assert ledger[1].replaced_by is not ledger[2].replaced_by, "each entry owns its list"
    with pytest.raises(ValueError, match="ledger id 3 is live; only a culled token can be replaced"):
        ledger.link_replacement([3], [new])
    with pytest.raises(ValueError, match="ledger id 1 is replaced"):
        ledger.resurrect(1, brightness=1.0)
    assert (ledger.count(LIVE), ledger.count(CULLED), ledger.count(REPLACED)) == (3, 0, 2)


def test_truncate_forgets_only_the_entries_added_after_that_length():
    ledger = ledger_of(5)
    ledger.truncate(3)
    assert [e.token_id for e in ledger.entries] == [100, 101, 102]
    assert ledger.add(9, "y", "generated", tick=1, brightness=1.0) == 3, "the next id follows the kept entries"
