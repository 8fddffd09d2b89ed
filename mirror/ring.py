"""Where a ring store keeps each live row: the slot mapping, in pure Python.

A ring store (positronic/kv/ring.py, `RingLayer`) has `capacity` slots. Live rows 0..sinks-1
(the attention sinks) sit in slots 0..sinks-1 for good; the other rows, the window, sit in the
remaining slots as a ring that wraps modulo `capacity - sinks`, starting at the `cursor` (the
slot of the oldest window row):

    slot(row) = row                                              row < sinks
              = sinks + (cursor - sinks + row - sinks) % (capacity - sinks)   otherwise

So evicting the oldest window rows (what the streaming policy does) is only a move of the
cursor, and a new row goes to the slot after the newest one. The cache and the mirror hold the
same `Ring` after every edit (StateManager hands the cache's to `Mirror.splice`), which is how
the mirror records the cursor; readers map live rows to slots with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ring:
    """sinks: rows in fixed slots; capacity: slots in all; cursor: the slot of the oldest
    window row (sinks <= cursor < capacity)."""

    sinks: int
    capacity: int
    cursor: int

    def __post_init__(self):
        for name in ("sinks", "capacity", "cursor"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"ring {name} must be an int, got {getattr(self, name)!r}")
        if not 0 <= self.sinks < self.capacity:
            raise ValueError(f"a ring of {self.capacity} slots cannot keep {self.sinks} sinks (0 <= sinks < capacity)")
        if not self.sinks <= self.cursor < self.capacity:
            raise ValueError(f"ring cursor {self.cursor} lies outside the window slots {self.sinks}..{self.capacity - 1}")

    @property
    def window(self) -> int:
        """Slots of the ring part."""
        return self.capacity - self.sinks

    def slot(self, row: int) -> int:
        if row < self.sinks:
            return row
        return self.sinks + (self.cursor - 2 * self.sinks + row) % self.window

    def slots(self, rows) -> list[int]:
        return [self.slot(row) for row in rows]

    def used(self, length: int) -> int:
        """Slots 0..used-1 hold every one of `length` live rows (and, if the window does not
        start at slot `sinks` or has not come round yet, some free slots: a reader masks them)."""
        if length <= self.sinks:
            return length
        end = self.cursor + length - self.sinks
        return end if end <= self.capacity else self.capacity

    def free(self, length: int) -> range:
        """The free slots among 0..used-1 with `length` live rows: one run, between the newest
        window row and the oldest (empty while the ring is full or linear)."""
        if length <= self.sinks:
            return range(0)
        end = self.cursor + length - self.sinks
        if end <= self.capacity:
            return range(self.sinks, self.cursor)
        return range(end - self.window, self.cursor)

    def linear(self, length: int) -> bool:
        """True when row i sits in slot i for every live row."""
        return length <= self.sinks or (self.cursor == self.sinks and length <= self.capacity)

    def after(self, kept: list[tuple[int, int, int]], length: int) -> "Ring":
        """The ring after a splice to `length` rows keeping the runs (old_row, new_row, count):
        the cursor moves so that the longest kept run of window rows stays in its slots (a
        streaming eviction, which drops the oldest window rows, then moves nothing). A layout
        longer than the capacity gets a ring twice as large (at least `length`), linear again."""
        if length > self.capacity:
            return Ring(self.sinks, max(length, 2 * self.capacity), self.sinks)
        best, cursor = 0, self.cursor
        for old, new, count in kept:
            skip = max(0, self.sinks - old, self.sinks - new)  # the part of the run in the window, both sides
            if count - skip > best:
                best = count - skip
                cursor = self.sinks + (self.cursor - self.sinks + old - new) % self.window
        return Ring(self.sinks, self.capacity, cursor)

    def moves(self, kept: list[tuple[int, int, int]], new: "Ring", *, every: bool = False) -> tuple[list[int], list[int]]:
        """(from slots, to slots) of the kept rows whose slot changes from this ring to `new`
        (`every`: all kept rows, for a copy into another buffer). Worked out run by run: a
        piece of a run that stays in place costs nothing, so a streaming eviction is O(runs)."""
        source, target = [], []
        for old, new_row, count in kept:
            # split the run where either side crosses from the sinks into the window
            cuts = sorted({0, count} | {c for c in (self.sinks - old, self.sinks - new_row) if 0 < c < count})
            for a, b in zip(cuts, cuts[1:]):
                o, n = old + a, new_row + a
                if not every and self.slot(o) == new.slot(n) and (o < self.sinks) == (n < new.sinks) \
                        and (o < self.sinks or self.window == new.window):
                    continue  # the same shift for every row of the piece: it stays where it is
                source += self.slots(range(o, o + b - a))
                target += new.slots(range(n, n + b - a))
        return source, target

    def to_dict(self) -> dict:
        return {"sinks": self.sinks, "capacity": self.capacity, "cursor": self.cursor}

    @classmethod
    def from_dict(cls, data) -> "Ring":
        """ValueError unless `data` is exactly {sinks, capacity, cursor} of a valid ring."""
        if not isinstance(data, dict) or set(data) != {"sinks", "capacity", "cursor"}:
            raise ValueError(f"a ring is {{sinks, capacity, cursor}}, got {data!r}")
        return cls(data["sinks"], data["capacity"], data["cursor"])
