"""Per-layer live maps: which tokens each layer's cache holds, when layers keep different rows.

Under a per-layer policy (SmartKV) every layer keeps its own rows, the same number in each
layer. The ledger stays one and the Mirror's live map becomes the *union*: every token that
at least one layer holds, at its RoPE position. `LayerRows` says, per layer, which of those
tokens the layer holds, as ledger ids in that layer's cache-row order (ascending position,
so each layer's rows are a subsequence of the union's). Row i of layer l's cache holds
`rows[l][i]`; its position is the union's position of that ledger id.

It changes only as a whole, with the Layout of the union (Mirror.splice): a tick drops some
rows in some layers and appends the tick's new tokens to every layer.
"""

from __future__ import annotations


class LayerRowsError(ValueError):
    """Per-layer rows that do not describe a consistent cache."""


class LayerRows:
    """rows[l]: the ledger ids layer l holds, in its cache-row order."""

    def __init__(self, rows: list[list[int]]):
        if not rows:
            raise LayerRowsError("per-layer rows need at least one layer")
        self.rows = [list(layer) for layer in rows]

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
        count: dict[int, int] = {}
        for layer in self.rows:
            for ledger_id in layer:
                count[ledger_id] = count.get(ledger_id, 0) + 1
        return [count.get(ledger_id, 0) for ledger_id in ledger_ids]

    def held(self) -> set[int]:
        """Ledger ids held by at least one layer."""
        return {ledger_id for layer in self.rows for ledger_id in layer}

    def after(self, drops: list[list[int]], new_ids: list[int]) -> "LayerRows":
        """The rows once each layer l has dropped its rows `drops[l]` (row numbers in that
        layer) and every layer has appended `new_ids`. LayerRowsError if a drop is out of range
        or the layers would end with different lengths."""
        if len(drops) != self.num_layers:
            raise LayerRowsError(f"{len(drops)} drop lists for {self.num_layers} layers")
        rows = []
        for l, (layer, dropped) in enumerate(zip(self.rows, drops)):
            gone = set(dropped)
            if len(gone) != len(dropped) or any(not 0 <= row < len(layer) for row in gone):
                raise LayerRowsError(f"layer {l}: dropped rows {sorted(dropped)} are repeated or out of "
                                     f"range 0..{len(layer) - 1}")
            rows.append([ledger_id for row, ledger_id in enumerate(layer) if row not in gone] + list(new_ids))
        if len({len(layer) for layer in rows}) != 1:
            raise LayerRowsError("the layers would hold different numbers of rows: "
                                 f"{sorted({len(layer) for layer in rows})}")
        return LayerRows(rows)

    def check(self, union_ids: list[int]) -> None:
        """LayerRowsError unless every layer holds the same number of rows, each a
        subsequence of `union_ids` (the live map's, in order) without repeats, and every
        union id is held by some layer."""
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
