"""The live map: one entry per KV-cache row, in cache order.

Each row records the ledger id of the token held there and the RoPE position its key was
rotated with. It is edited with exactly the splices the tensors get (delete at i, insert
at i, append), so row i of the map always describes row i of the cache.
"""

from __future__ import annotations


class LiveMap:
    """ledger_ids[i] / positions[i] describe cache row i."""

    def __init__(self, ledger_ids: list[int] | None = None, positions: list[int] | None = None):
        self.ledger_ids: list[int] = ledger_ids if ledger_ids is not None else []
        self.positions: list[int] = positions if positions is not None else []
        if len(self.ledger_ids) != len(self.positions):
            raise ValueError("live map needs one position per ledger id")

    def __len__(self) -> int:
        return len(self.ledger_ids)

    def delete(self, index: int) -> int:
        """Remove row `index`; returns the ledger id it held."""
        self._check_index(index, len(self))
        del self.positions[index]
        return self.ledger_ids.pop(index)

    def insert(self, index: int, ledger_ids: list[int], positions: list[int]) -> None:
        """Insert rows before row `index` (index == len appends)."""
        self._check_index(index, len(self) + 1)
        if len(ledger_ids) != len(positions):
            raise ValueError("insert needs one position per ledger id")
        self.ledger_ids[index:index] = ledger_ids
        self.positions[index:index] = positions

    def append(self, ledger_ids: list[int], positions: list[int]) -> None:
        self.insert(len(self), ledger_ids, positions)

    def set_positions(self, positions: list[int]) -> None:
        """Record that every row's key was re-rotated to a new position."""
        if len(positions) != len(self):
            raise ValueError(f"{len(positions)} positions for {len(self)} live rows")
        self.positions = list(positions)

    @staticmethod
    def _check_index(index: int, limit: int) -> None:
        if not 0 <= index < limit:
            raise IndexError(f"row {index} out of range 0..{limit - 1}")
