"""Step 3b: the one selector. Which rows a policy may touch, and its dimmest units.

A unit is `size` adjacent rows edited together: a row (1), a pair (2, what the repairers
replace), a chunk (n). Every policy selects through `select_units`, with the one
protected-rows rule of `selectable_rows`.
"""
from __future__ import annotations

import heapq
from typing import Iterable, Sequence


def selectable_rows(length: int, *, sinks: int = 4, protect: int = 0, window: int = 0) -> range:
    """Rows that may be edited: everything after the first max(sinks, protect) rows
    and before the last `window` rows. Empty when the protected zones cover everything."""
    for name, value in (("length", length), ("sinks", sinks), ("protect", protect), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    start = min(max(sinks, protect), length)  # both count from row 0: the longer prefix wins
    return range(start, max(start, length - window))


def protected_rows(length: int, *, sinks: int = 4, protect: int = 0, window: int = 0) -> frozenset[int]:
    """The rows (of `length` live rows) that no edit may touch."""
    free = selectable_rows(length, sinks=sinks, protect=protect, window=window)
    return frozenset(range(length)) - frozenset(free)


def select_units(
    values: Sequence[float],
    count: int,
    *,
    size: int = 2,
    sinks: int = 4,
    protect: int = 0,
    window: int = 0,
    exclude: Iterable[int] = (),
) -> list[tuple[int, ...]]:
    """Up to `count` non-overlapping units of `size` adjacent rows, none touching a protected row
    or a row in `exclude` (rows already taken by an earlier selection).

    values: one per live row, lower = less worth keeping. A unit's value is the max of its
    rows' (a unit is only as dim as its brightest row); units are taken greedily, lowest
    value first, ties to the lower row. Returned in that order (the caller may stop early,
    e.g. once enough rows are freed). O(n·size + count·log n) per call.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    free = selectable_rows(len(values), sinks=sinks, protect=protect, window=window)
    heap = [(max(values[p : p + size]), p) for p in range(free.start, free.stop - size + 1)]
    heapq.heapify(heap)
    taken: set[int] = set(exclude)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < count:
        _, p = heapq.heappop(heap)
        unit = tuple(range(p, p + size))
        if taken.intersection(unit):
            continue
        taken.update(unit)
        chosen.append(unit)
    return chosen
