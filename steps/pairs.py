"""Step 3b: choose the dimmest adjacent pairs of rows to repair or cull."""
from __future__ import annotations

import heapq


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


def select_pairs(
    brightness: list[float],
    count: int,
    *,
    sinks: int = 4,
    protect: int = 0,
    window: int = 0,
) -> list[tuple[int, int]]:
    """Up to `count` non-overlapping adjacent pairs (p, p+1), none touching a protected row.

    brightness: one value per live row. A pair's score is max(b[p], b[p+1]) (a pair is only
    as dim as its brighter row); pairs are taken greedily, lowest score first, ties to
    the lower position. Returned sorted by position. O(n + count·log n) per call.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    free = selectable_rows(len(brightness), sinks=sinks, protect=protect, window=window)
    heap = [(max(brightness[p], brightness[p + 1]), p) for p in range(free.start, free.stop - 1)]
    heapq.heapify(heap)
    taken: set[int] = set()
    chosen: list[tuple[int, int]] = []
    while heap and len(chosen) < count:
        _, p = heapq.heappop(heap)
        if p in taken or p + 1 in taken:
            continue
        taken.update((p, p + 1))
        chosen.append((p, p + 1))
    return sorted(chosen)
