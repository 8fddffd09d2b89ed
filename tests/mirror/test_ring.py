"""mirror/ring.py: the ring store's slot of every row, how a splice moves the cursor, and the
ring in mirror files."""

import random

import pytest

from positronic.mirror import Insertion, Mirror, MirrorFileError, Ring, from_bytes, plan_layout, to_bytes
from positronic.mirror.storage import from_columns, to_columns


def test_sinks_keep_their_slots_and_the_window_wraps_from_the_cursor():
    ring = Ring(sinks=2, capacity=7, cursor=5)
    assert ring.slots(range(7)) == [0, 1, 5, 6, 2, 3, 4]
    assert sorted(ring.slots(range(7))) == list(range(7)), "a full ring uses every slot once"
    assert ring.used(4) == 7 and ring.used(3) == 6 and ring.used(2) == 2
    assert not ring.linear(3) and Ring(2, 7, 2).linear(7) and ring.linear(2)


def test_a_streaming_eviction_only_moves_the_cursor():
    """Dropping the oldest window rows and appending one: nothing moves, the cursor advances
    by the rows dropped, round the end of the buffer."""
    ring = Ring(sinks=4, capacity=20, cursor=17)
    kept = [(0, 0, 4), (4 + 5, 4, 11)]  # 20 rows, rows 4..8 go, a new row 15 comes
    after = ring.after(kept, 16)
    assert after.cursor == 4 + (17 - 4 + 5) % 16 == 6
    assert ring.moves(kept, after) == ([], [])
    assert [after.slot(new) for new in range(4, 15)] == [ring.slot(old) for old in range(9, 20)]


def simulate(ring, slots, rows, layout):
    """Apply ring.after/moves to a buffer of row labels; return the new ring and buffer."""
    after = ring.after(list(layout.kept), layout.length)
    grow = after.capacity != ring.capacity
    source, target = ring.moves(list(layout.kept), after, every=grow)
    buffer = list(slots) + [None] * (after.capacity - ring.capacity)
    moved = [buffer[s] for s in source]
    for t, label in zip(target, moved):
        buffer[t] = label
    return after, buffer, len(source)


@pytest.mark.parametrize("seed", range(20))
def test_any_layout_keeps_every_surviving_row_reachable_through_its_slot(seed):
    """Random deletions and insertions (and growth past the capacity): after the moves, every
    kept row's label sits in the slot the new ring maps its new row to."""
    rng = random.Random(seed)
    sinks, capacity = rng.randint(0, 4), rng.randint(8, 24)
    ring = Ring(sinks, capacity, rng.randint(sinks, capacity - 1))
    rows = list(range(rng.randint(1, capacity)))  # labels
    buffer = [None] * capacity
    for row, label in enumerate(rows):
        buffer[ring.slot(row)] = label
    label = len(rows)
    for _ in range(30):
        n = len(rows)
        deleted = sorted(rng.sample(range(n), rng.randint(0, n - 1)))
        at = rng.randint(0, n)
        new = rng.randint(0, 4) if rng.random() < 0.5 else 1
        insertions = [Insertion(at, tuple(range(new)), "generated")] if new else []
        if not insertions and not deleted:
            continue
        layout = plan_layout(list(range(0, 10 * n, 10)), deleted, insertions, 10 ** 9)
        ring, buffer, _ = simulate(ring, buffer, rows, layout)
        after = [None] * layout.length
        for old, new_row, count in layout.kept:
            after[new_row:new_row + count] = rows[old:old + count]
        for row in layout.new_rows:
            after[row] = label
            buffer[ring.slot(row)] = label
            label += 1
        rows = after
        assert [buffer[ring.slot(row)] for row in range(len(rows))] == rows
        assert len(set(ring.slots(range(len(rows))))) == len(rows)


@pytest.mark.parametrize("sinks,capacity", [(0, 7), (2, 9), (4, 12)])
def test_the_free_slots_are_the_used_slots_no_row_holds(sinks, capacity):
    for cursor in range(sinks, capacity):
        ring = Ring(sinks, capacity, cursor)
        for length in range(capacity + 1):
            held = set(ring.slots(range(length)))
            assert len(held) == length
            assert set(ring.free(length)) == set(range(ring.used(length))) - held


def test_a_bad_ring_is_refused():
    for data in ({"sinks": 4, "capacity": 4, "cursor": 4}, {"sinks": 0, "capacity": 8, "cursor": 8},
                 {"sinks": 1, "capacity": 8, "cursor": 0}, {"sinks": True, "capacity": 8, "cursor": 1},
                 {"sinks": 1, "capacity": 8}, [1, 8, 1]):
        with pytest.raises(ValueError):
            Ring.from_dict(data)


def built(ring):
    mirror = Mirror(ring=ring)
    layout = plan_layout([], [], [Insertion(0, (5, 6, 7), "prompt")], 100)
    mirror.splice(layout, ["a", "b", "c"], tick=0, brightness=255.0, ring=ring)
    return mirror


def test_the_ring_is_saved_only_when_there_is_one_and_comes_back():
    assert "ring" not in to_columns(Mirror())
    mirror = built(Ring(1, 8, 5))
    back, _ = from_bytes(to_bytes(mirror))
    assert back.ring == Ring(1, 8, 5) and back.live.ledger_ids == mirror.live.ledger_ids


def test_a_file_with_a_broken_ring_is_refused():
    columns = to_columns(built(Ring(1, 8, 5)))
    columns["ring"]["cursor"] = 9
    with pytest.raises(MirrorFileError, match="cursor"):
        from_columns(columns)
    columns["ring"] = {"sinks": 0, "capacity": 2, "cursor": 0}  # 3 live rows do not fit 2 slots
    with pytest.raises(MirrorFileError, match="do not fit"):
        from_columns(columns)


def test_a_ring_mirror_takes_edits_only_with_the_ring_after_them():
    mirror = built(Ring(1, 8, 1))
    layout = plan_layout(mirror.live.positions, [1], [], 100)
    with pytest.raises(ValueError, match="ring"):
        mirror.splice(layout, [], tick=1, brightness=255.0)
    assert mirror.ring == Ring(1, 8, 1) and len(mirror) == 3, "a refusal changes nothing"
    mirror.splice(layout, [], tick=1, brightness=255.0, ring=Ring(1, 8, 2))
    assert mirror.ring == Ring(1, 8, 2)
