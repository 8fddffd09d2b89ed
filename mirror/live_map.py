"""The live map: one entry per KV-cache row, in cache order.

Each row records the ledger id of the token held there and the RoPE position its key was
rotated with. It changes only by taking a whole `Layout` (Mirror.splice), the same one the
cache moves its rows by, so row i of the map always describes row i of the cache.
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
