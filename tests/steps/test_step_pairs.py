import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steps.pairs import protected_rows, select_pairs, selectable_rows


def test_dimmest_pairs_lowest_first_and_sinks_skipped():
    # The sinks are the dimmest rows of all and must still be skipped.
    b = [0, 0, 0, 0, 5, 1, 7, 3, 3, 9, 9]
    # pair scores from p=4: 5, 7, 7, 3, 9, 9
    assert select_pairs(b, 1) == [(7, 8)]
    assert select_pairs(b, 2) == [(4, 5), (7, 8)]


def test_pair_score_is_max_of_the_two_rows():
    # (4,5) holds the dimmest row but scores 10; (6,7) scores 4.
    b = [9, 9, 9, 9, 0, 10, 4, 4]
    assert select_pairs(b, 1) == [(6, 7)]


def test_ties_go_to_lower_position():
    assert select_pairs([1.0] * 12, 1) == [(4, 5)]
    assert select_pairs([1.0] * 12, 3) == [(4, 5), (6, 7), (8, 9)]


def test_pairs_do_not_overlap():
    # (4,5) and (5,6) tie at 5; (4,5) wins and (5,6) is then blocked.
    b = [9, 9, 9, 9, 5, 0, 5, 9]
    assert select_pairs(b, 2) == [(4, 5), (6, 7)]


def test_result_sorted_by_position_not_by_score():
    b = [9, 9, 9, 9, 2, 2, 1, 1]
    assert select_pairs(b, 2) == [(4, 5), (6, 7)]


def test_protect_prefix_and_window():
    b = [0.0] * 20
    assert select_pairs(b, 1, sinks=4, protect=7) == [(7, 8)]
    assert select_pairs(b, 1, sinks=4, protect=2) == [(4, 5)]
    assert select_pairs([5.0] * 16 + [0.0] * 4, 1, window=4) == [(4, 5)]
    assert select_pairs(b, 100, sinks=0, window=15) == [(0, 1), (2, 3)]


def test_count_zero_too_short_and_fully_protected():
    assert select_pairs([1.0] * 10, 0) == []
    assert select_pairs([1.0] * 5, 3) == []
    assert select_pairs([1.0] * 10, 3, sinks=4, window=6) == []
    assert select_pairs([], 2) == []


def test_count_larger_than_available():
    assert select_pairs([1.0] * 9, 10) == [(4, 5), (6, 7)]


def test_protected_rows():
    assert protected_rows(10, sinks=4, protect=2, window=3) == {0, 1, 2, 3, 7, 8, 9}
    assert protected_rows(10, sinks=0, protect=6, window=0) == set(range(6))
    assert protected_rows(5, sinks=4, window=3) == set(range(5))
    assert protected_rows(3, sinks=4) == {0, 1, 2}
    assert selectable_rows(10, sinks=4, protect=2, window=3) == range(4, 7)


@pytest.mark.parametrize(
    "kwargs", [{"sinks": -1}, {"protect": -1}, {"window": -2}, {"sinks": 1.5}]
)
def test_invalid_protection_raises(kwargs):
    with pytest.raises(ValueError):
        select_pairs([1.0] * 10, 1, **kwargs)


@pytest.mark.parametrize("count", [-1, 1.0, True])
def test_invalid_count_raises(count):
    with pytest.raises(ValueError, match="count"):
        select_pairs([1.0] * 10, count)


def reference(b, count, sinks, protect, window):
    """Independent greedy: repeatedly scan for the lowest (score, position) free pair."""
    n = len(b)
    guarded = set(range(min(n, max(sinks, protect)))) | set(range(max(0, n - window), n))
    used, out = set(), []
    while len(out) < count:
        best = None
        for p in range(n - 1):
            if {p, p + 1} & (guarded | used):
                continue
            key = (max(b[p], b[p + 1]), p)
            if best is None or key < best:
                best = key
        if best is None:
            break
        used |= {best[1], best[1] + 1}
        out.append((best[1], best[1] + 1))
    return sorted(out)


@settings(max_examples=300, deadline=None)
@given(
    b=st.lists(st.integers(0, 6).map(float), max_size=40),  # few values -> many ties
    count=st.integers(0, 12),
    sinks=st.integers(0, 6),
    protect=st.integers(0, 12),
    window=st.integers(0, 12),
)
def test_property_matches_greedy_and_respects_protection(b, count, sinks, protect, window):
    got = select_pairs(b, count, sinks=sinks, protect=protect, window=window)
    guarded = protected_rows(len(b), sinks=sinks, protect=protect, window=window)
    rows = [r for pair in got for r in pair]
    assert len(got) <= count
    assert all(q == p + 1 for p, q in got)
    assert len(rows) == len(set(rows)), "pairs overlap"
    assert not set(rows) & guarded, "touched a protected row"
    assert got == sorted(got)
    assert got == reference(b, count, sinks, protect, window)


def test_ten_thousand_rows_is_fast():
    rng = random.Random(0)
    b = [rng.uniform(0, 255) for _ in range(10_000)]
    t0 = time.perf_counter()
    for _ in range(10):
        select_pairs(b, 2, sinks=4, protect=100, window=32)
    assert (time.perf_counter() - t0) / 10 < 0.05
