"""The live rows after a set of edits, worked out before anything is touched.

A tick's edits (deletions, insertions) all refer to rows as they were before the tick.
`plan_layout` turns them into one `Layout`: where every surviving row goes, which rows the
new tokens take, and the RoPE position of every row afterwards. Both blades are then edited
from the same Layout: the mirror's live map takes its lists, the cache moves its rows by its
runs and re-rotates the keys whose position changed.

Positions: a new token takes the position right after its left neighbour's, or the one the
insertion names (a resurrected token goes back to the position it held). Surviving rows
keep their positions unless that leaves no room, in which case they shift right by just
enough (and everything after them with them); if that would reach the model's limit, every
row is packed down to 0, 1, 2, …  Shifted keys are re-rotated, so a key is rounded only when
its position really moves.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Insertion:
    """New tokens in the place of old row `at` (which is usually deleted: a replacement), or
    before it; `at` = the old length appends. `replaces`: old rows these tokens stand for.
    `positions`: the tokens' RoPE positions, if they must have these (each above the row
    before); `restores`: the ledger ids these tokens are (culled tokens coming back)."""

    at: int
    token_ids: tuple[int, ...]
    source: str
    replaces: tuple[int, ...] = ()
    positions: tuple[int, ...] | None = None
    restores: tuple[int, ...] = ()


@dataclass(frozen=True)
class Layout:
    """The rows after the edits.

    kept: runs (old_row, new_row, count) of surviving rows, in order.
    new_rows: rows of the inserted tokens, ascending; new_token_ids: their ids, same order.
    groups: per Insertion (in new-row order), the slice of new_rows it fills.
    positions: RoPE position of every row afterwards.
    moved: first row whose key must be re-rotated (its position changed), or None; the
        rows from it on move from old_positions (new tokens: their own position) to positions.
    """

    old_length: int
    length: int
    deleted: tuple[int, ...]
    kept: tuple[tuple[int, int, int], ...]
    new_rows: tuple[int, ...]
    new_token_ids: tuple[int, ...]
    groups: tuple[tuple[Insertion, slice], ...]
    positions: tuple[int, ...]
    old_positions: tuple[int, ...]
    moved: int | None


def plan_layout(positions: list[int], deleted: set[int] | list[int], insertions: list[Insertion],
                limit: int) -> Layout:
    """The Layout after deleting old rows `deleted` and making `insertions`.

    positions: the RoPE position of every old row (strictly increasing). Raises ValueError if
    a row is out of range or the result would not fit the model's `limit` positions.
    """
    old_length = len(positions)
    deleted = set(deleted)
    if any(not 0 <= row < old_length for row in deleted):
        raise ValueError(f"deleted rows {sorted(deleted)} out of range 0..{old_length - 1}")
    appended = sum(len(insertion.token_ids) for insertion in insertions)
    if (all(insertion.at == old_length and insertion.positions is None and insertion.token_ids
            for insertion in insertions) and (positions[-1] if positions else -1) + appended < limit):
        return _deletions_and_appends(positions, deleted, insertions)
    return _row_by_row(positions, deleted, insertions, limit)


def _deletions_and_appends(positions: list[int], deleted: set[int], insertions: list[Insertion]) -> Layout:
    """`plan_layout` when every insertion appends tokens without positions of their own and the
    result stays below the limit (every tick of a per-layer policy: one union row or none
    dropped, the new token appended): survivors keep their positions, so the kept runs are
    list slices and nothing moves, in O(deleted + appended) Python steps instead of O(rows)."""
    old_length, deleted = len(positions), sorted(deleted)
    kept = runs_without(old_length, deleted)
    new_positions: list[int] = []
    for old, _, count in kept:
        new_positions += positions[old:old + count]
    old_positions = list(new_positions)
    previous = new_positions[-1] if new_positions else -1
    new_rows, new_ids, groups = [], [], []
    for insertion in insertions:
        first = len(new_rows)
        for token_id in insertion.token_ids:
            previous += 1
            new_rows.append(len(new_positions))
            new_ids.append(token_id)
            new_positions.append(previous)
            old_positions.append(previous)
        groups.append((insertion, slice(first, len(new_rows))))
    return Layout(old_length=old_length, length=len(new_positions), deleted=tuple(deleted), kept=tuple(kept),
                  new_rows=tuple(new_rows), new_token_ids=tuple(new_ids), groups=tuple(groups),
                  positions=tuple(new_positions), old_positions=tuple(old_positions), moved=None)


def _row_by_row(positions: list[int], deleted: set[int], insertions: list[Insertion], limit: int) -> Layout:
    """`plan_layout` for any edit: row by row, shifting rows right where an insertion needs
    room and packing every row down at the limit."""
    old_length = len(positions)
    by_row: dict[int, list[Insertion]] = {}
    for insertion in insertions:
        if not 0 <= insertion.at <= old_length:
            raise ValueError(f"insertion at row {insertion.at} out of range 0..{old_length}")
        if not insertion.token_ids:
            raise ValueError("an insertion needs at least one token")
        if insertion.positions is not None and len(insertion.positions) != len(insertion.token_ids):
            raise ValueError("an insertion with positions needs one per token")
        by_row.setdefault(insertion.at, []).append(insertion)

    new_positions: list[int] = []
    old_of_row: list[int] = []  # each row's position before (new tokens: their own)
    kept: list[list[int]] = []  # runs [old_row, new_row, count]
    new_rows: list[int] = []
    new_ids: list[int] = []
    groups: list[tuple[Insertion, slice]] = []
    previous, offset = -1, 0

    def place_new(insertion: Insertion) -> None:
        nonlocal previous
        first = len(new_rows)
        for index, token_id in enumerate(insertion.token_ids):
            if insertion.positions is None:
                previous += 1
            elif insertion.positions[index] > previous:
                previous = insertion.positions[index]
            else:
                raise ValueError(f"position {insertion.positions[index]} is not free: the row before is at {previous}")
            new_rows.append(len(new_positions))
            new_ids.append(token_id)
            new_positions.append(previous)
            old_of_row.append(None)
        groups.append((insertion, slice(first, len(new_rows))))

    for row in range(old_length + 1):
        for insertion in by_row.get(row, ()):
            place_new(insertion)
        if row == old_length or row in deleted:
            continue
        position = positions[row] + offset
        if position <= previous:  # no room left: this row and all after it shift right
            offset += previous + 1 - position
            position = previous + 1
        new_row = len(new_positions)
        if kept and kept[-1][0] + kept[-1][2] == row and kept[-1][1] + kept[-1][2] == new_row:
            kept[-1][2] += 1
        else:
            kept.append([row, new_row, 1])
        new_positions.append(position)
        old_of_row.append(positions[row])
        previous = position

    length = len(new_positions)
    if length > limit:
        raise ValueError(f"{length} rows do not fit the model's {limit} positions")
    if length and new_positions[-1] >= limit:  # pack everything down
        new_positions = list(range(length))
    old_positions = [p if old is None else old for p, old in zip(new_positions, old_of_row)]
    moved = next((row for row, (a, b) in enumerate(zip(old_positions, new_positions))
                  if a != b and old_of_row[row] is not None), None)
    return Layout(old_length=old_length, length=length, deleted=tuple(sorted(deleted)),
                  kept=tuple(tuple(run) for run in kept), new_rows=tuple(new_rows), new_token_ids=tuple(new_ids),
                  groups=tuple(groups), positions=tuple(new_positions), old_positions=tuple(old_positions),
                  moved=moved)


def runs_without(length: int, dropped: list[int], inserted: list[int] = ()) -> list[tuple[int, int, int]]:
    """Kept runs (old_row, new_row, count) of `length` rows once rows `dropped` are gone and
    new rows stand at `inserted` (ascending rows of the result): the survivors close up in
    order around them. What `plan_layout` gives for deletions and insertions, in
    O(dropped + inserted) steps (a per-layer edit computes one per layer every tick)."""
    if not dropped and not inserted:  # a lane under the budget: every row stays where it is
        return [(0, 0, length)] if length else []
    runs, start, new, at = [], 0, 0, 0
    for row in sorted(dropped) + [length]:
        count = row - start
        while count > 0:
            while at < len(inserted) and inserted[at] <= new:  # a new row here: the survivors go after it
                new, at = new + 1, at + 1
            take = count if at == len(inserted) else min(count, inserted[at] - new)
            runs.append((start, new, take))
            start, new, count = start + take, new + take, count - take
        start = row + 1
    return runs
