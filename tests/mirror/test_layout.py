"""plan_layout: where every row goes and which RoPE position it gets, before anything moves."""

import pytest

from positronic.mirror import Insertion, plan_layout


def test_replacement_and_add_keep_positions_where_there_is_room():
    positions = [0, 1, 2, 5, 6, 7, 8]
    layout = plan_layout(positions, {3, 4}, [Insertion(3, (90,), "repair", replaces=(3, 4)),
                                            Insertion(7, (91,), "generated")], limit=100)
    assert layout.length == 7
    assert layout.kept == ((0, 0, 3), (5, 4, 2))
    assert layout.new_rows == (3, 6) and layout.new_token_ids == (90, 91)
    assert layout.positions == (0, 1, 2, 3, 7, 8, 9)
    assert layout.moved is None, "nothing had to be re-rotated"


def test_no_room_shifts_the_rows_after_by_just_enough():
    positions = [0, 1, 2, 3, 4, 5]
    layout = plan_layout(positions, {2, 3}, [Insertion(2, (7, 8, 9), "repair", replaces=(2, 3))], limit=100)
    # three tokens where two were: the new ones take 2, 3, 4; rows 4 and 5 move to 5 and 6
    assert layout.positions == (0, 1, 2, 3, 4, 5, 6)
    assert layout.moved == 5 and layout.old_positions[5:] == (4, 5)


def test_two_insertions_compose_their_shifts():
    positions = list(range(10))
    layout = plan_layout(positions, {2, 3, 6, 7}, [Insertion(2, (1, 1, 1), "repair", replaces=(2, 3)),
                                                  Insertion(6, (2, 2, 2), "repair", replaces=(6, 7))], limit=100)
    assert layout.positions == tuple(range(12))
    assert layout.old_positions == (0, 1, 2, 3, 4, 4, 5, 7, 8, 9, 8, 9)  # new tokens: their own
    assert layout.moved == 5
    assert [layout.positions[r] for r in layout.new_rows] == [2, 3, 4, 7, 8, 9]


def test_reaching_the_limit_packs_every_row_down():
    positions = [0, 5, 9]
    layout = plan_layout(positions, set(), [Insertion(3, (1,), "generated")], limit=10)
    assert layout.positions == (0, 1, 2, 3)
    assert layout.moved == 1 and layout.old_positions == (0, 5, 9, 3)


def test_a_non_adjacent_pair_keeps_the_rows_inside_it_and_refers_to_rows_before_the_tick():
    positions = list(range(10))
    # replace rows 4 and 7 by two tokens, and delete original row 5: row 6 survives
    layout = plan_layout(positions, {4, 7, 5}, [Insertion(4, (300, 301), "repair", replaces=(4, 7))], limit=100)
    order = sorted([(new + k, ("old", old + k)) for old, new, count in layout.kept for k in range(count)]
                   + [(row, ("new", t)) for row, t in zip(layout.new_rows, layout.new_token_ids)])
    assert [what for _, what in order] == [("old", 0), ("old", 1), ("old", 2), ("old", 3), ("new", 300),
                                           ("new", 301), ("old", 6), ("old", 8), ("old", 9)]


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        plan_layout([0, 1], {2}, [], limit=10)
    with pytest.raises(ValueError, match="insertion at row 3 out of range"):
        plan_layout([0, 1], set(), [Insertion(3, (1,), "generated")], limit=10)
    with pytest.raises(ValueError, match="at least one token"):
        plan_layout([0, 1], set(), [Insertion(1, (), "generated")], limit=10)
    with pytest.raises(ValueError, match="3 rows do not fit the model's 2 positions"):
        plan_layout([0, 1], set(), [Insertion(2, (1,), "generated")], limit=2)


def test_the_fast_path_for_deletions_and_appends_gives_the_row_by_row_layout():
    """A per-layer tick drops union rows and appends its token: plan_layout takes list slices
    then, and must lay out exactly what the general row-by-row walk lays out."""
    import random

    from positronic.mirror.layout import _row_by_row

    rng = random.Random(0)
    fast = 0
    for _ in range(400):
        length = rng.randrange(0, 40)
        positions = sorted(rng.sample(range(60), length))
        deleted = set(rng.sample(range(length), rng.randrange(0, length + 1))) if length else set()
        insertions = [Insertion(length, tuple(rng.randrange(5, 99) for _ in range(rng.randrange(1, 4))), "add")
                      for _ in range(rng.randrange(0, 3))]
        limit = rng.choice([64, 80, 4096])
        try:
            want = _row_by_row(positions, deleted, insertions, limit)
        except ValueError:
            continue
        got = plan_layout(positions, deleted, insertions, limit)
        assert got == want, (positions, deleted, insertions, limit)
        fast += (positions[-1] if positions else -1) + sum(len(i.token_ids) for i in insertions) < limit
    assert fast > 300  # the fast path itself was exercised, not only the fallback
