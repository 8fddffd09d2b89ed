"""Per-layer live maps: which tokens each layer's cache holds, when layers keep different rows.

Under a per-layer policy (SmartKV) every layer keeps its own rows, the same number in each
layer. The ledger stays one and the Mirror's live map becomes the *union*: every token that
at least one layer holds, at its RoPE position. `LayerRows` says, per layer, which of those
tokens the layer holds, as ledger ids in that layer's cache-row order (ascending position,
so each layer's rows are a subsequence of the union's). Row i of layer l's cache holds
`rows[l][i]`; its position is the union's position of that ledger id.

It changes only as a whole, with the Layout of the union (Mirror.splice): a tick drops some
rows in some layers, takes some tokens back into some layers (recall) and appends the tick's
new tokens to every layer.

A "layer" here is a *lane*: a layer, or with per-head rows one kv head of a layer (lane =
layer * kv_heads + head). Nothing in this module depends on which: the state says how many
lanes a layer has (StateManager.lanes_per_layer).
"""

from __future__ import annotations


class LayerRowsError(ValueError):
    """Per-layer rows that do not describe a consistent cache."""


class LayerRows:
    """rows[l]: the ledger ids layer l holds, in its cache-row order; `counts`: how many layers
    hold each ledger id (kept up to date by `after`, so a tick never recounts every row)."""

    def __init__(self, rows: list[list[int]], counts: dict[int, int] | None = None, *, owned: bool = False):
        if not rows:
            raise LayerRowsError("per-layer rows need at least one layer")
        # owned: lists built for this object alone (by after), not copied again: a tick
        # of a per-head state replaces 90 lists of up to budget ids
        self.rows = rows if owned else [list(layer) for layer in rows]
        if counts is None:
            counts = {}
            for layer in self.rows:
                for ledger_id in layer:
                    counts[ledger_id] = counts.get(ledger_id, 0) + 1
        self.counts = counts
        self._last: tuple | None = None  # (drops, inserts) -> rows: `after` without appends, the last asked

    @staticmethod
    def every_layer(num_layers: int, ledger_ids: list[int]) -> "LayerRows":
        """Every layer holds the same rows (after a prefill, before any per-layer drop)."""
        return LayerRows([list(ledger_ids) for _ in range(num_layers)])

    @property
    def num_layers(self) -> int:
        return len(self.rows)

    def __len__(self) -> int:
        """Rows per layer (the same in every layer)."""
        return len(self.rows[0])

    def occupancy(self, ledger_ids: list[int]) -> list[int]:
        """How many layers hold each of `ledger_ids`."""
        return [self.counts.get(ledger_id, 0) for ledger_id in ledger_ids]

    def held(self) -> set[int]:
        """Ledger ids held by at least one layer."""
        return set(self.counts)

    def after(self, drops: list[list[int]], new_ids: list[int], inserts: list[list[int]] | None = None) -> "LayerRows":
        """The rows once each layer l has dropped its rows `drops[l]` (row numbers in that
        layer), taken back the ledger ids `inserts[l]` (tokens it does not hold; each goes in
        at its place in position order, which is ledger-id order here) and appended `new_ids`
        like every layer. LayerRowsError if a drop is out of range, a token is taken back
        twice, or the layers would end with different lengths.

        A tick asks twice with the same drops (the plan, without its new token; the mirror's
        commit, with it), so the rows after the drops are kept for the next ask: a LayerRows
        never changes once built, so the same drops give the same rows."""
        inserts = inserts or [[] for _ in self.rows]
        key = (tuple(map(tuple, drops)), tuple(map(tuple, inserts)))
        if self._last is not None and self._last[0] == key:
            dropped = self._last[1]
        else:
            dropped = self._dropped(drops, inserts)
            if dropped is not self:  # nothing dropped is itself: nothing to keep (and no cycle to leave to the gc)
                self._last = (key, dropped)
        if not new_ids:
            return dropped
        counts = dict(dropped.counts)
        for ledger_id in new_ids:
            counts[ledger_id] = counts.get(ledger_id, 0) + len(dropped.rows)
        return LayerRows([layer + list(new_ids) for layer in dropped.rows], counts, owned=True)

    def _dropped(self, drops: list[list[int]], inserts: list[list[int]]) -> "LayerRows":
        """`after` with nothing appended (its checks and its rows)."""
        if len(drops) != self.num_layers or len(inserts) != self.num_layers:
            raise LayerRowsError(f"{len(drops)} drop lists and {len(inserts)} insert lists for {self.num_layers} layers")
        if len({len(dropped) - len(taken) for dropped, taken in zip(drops, inserts)}) != 1:
            raise LayerRowsError("the layers would hold different numbers of rows: they drop "
                                 f"{sorted({len(d) - len(t) for d, t in zip(drops, inserts)})} more than they take back")
        if not any(drops) and not any(inserts):  # a tick under the budget: the same rows (a LayerRows never changes)
            return self
        rows, counts = [], dict(self.counts)
        # every lane of a per-head policy passes here once a tick: the checks are whole-list
        # operations, not a Python step per row
        for l, (layer, dropped, taken) in enumerate(zip(self.rows, drops, inserts)):
            order = sorted(dropped, reverse=True)
            if order and (order[0] >= len(layer) or order[-1] < 0) or len(set(order)) != len(order):
                raise LayerRowsError(f"layer {l}: dropped rows {sorted(dropped)} are repeated or out of "
                                     f"range 0..{len(layer) - 1}")
            kept = list(layer)
            for row in order:
                ledger_id = kept.pop(row)
                counts[ledger_id] -= 1
                if not counts[ledger_id]:
                    del counts[ledger_id]
            if taken:
                wanted = set(taken)
                if len(wanted) != len(taken) or not wanted.isdisjoint(kept):
                    raise LayerRowsError(f"layer {l}: ledger ids {sorted(taken)} are taken back twice or already held")
                kept = sorted(kept + list(taken))  # ids ascend with position under per-layer rows
                for ledger_id in taken:
                    counts[ledger_id] = counts.get(ledger_id, 0) + 1
            rows.append(kept)
        return LayerRows(rows, counts, owned=True)

    def check(self, union_ids: list[int]) -> None:
        """LayerRowsError unless the union's ids ascend, every layer holds the same number of rows, each a
        subsequence of `union_ids` (the live map's, in order) without repeats, and every
        union id is held by some layer."""
        if any(a >= b for a, b in zip(union_ids, union_ids[1:])):
            # per-layer states only ever append, so ids grow with position (searches rely on it)
            raise LayerRowsError("live ledger ids must ascend with position under per-layer rows")
        order = {ledger_id: row for row, ledger_id in enumerate(union_ids)}
        lengths = {len(layer) for layer in self.rows}
        if len(lengths) != 1:
            raise LayerRowsError(f"layers hold different numbers of rows: {sorted(lengths)}")
        for l, layer in enumerate(self.rows):
            previous = -1
            for row, ledger_id in enumerate(layer):
                where = order.get(ledger_id)
                if where is None:
                    raise LayerRowsError(f"layer {l} row {row} holds ledger id {ledger_id}, which is not live")
                if where <= previous:
                    raise LayerRowsError(f"layer {l} row {row}: ledger id {ledger_id} is out of position order "
                                         "(or repeated)")
                previous = where
        missing = set(union_ids) - self.held()
        if missing:
            raise LayerRowsError(f"live ledger ids {sorted(missing)[:5]} are held by no layer")
        if self.counts != LayerRows(self.rows).counts:
            raise LayerRowsError("the per-token layer counts do not match the rows")
