"""The ledger: an append-only record of every token the brain has ever held.

A ledger id is a row index into the ledger. Rows are never reordered or removed; a token
that leaves the context keeps its row with a new state (and the RoPE position it held), a
replaced token points at the ledger ids of the tokens that took its place, and a culled token
can come back to life at its old position (recall), counting its resurrections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LIVE = "live"
CULLED = "culled"
REPLACED = "replaced"
STATES = (LIVE, CULLED, REPLACED)

SOURCES = ("prompt", "generated", "repair", "inserted", "user")


@dataclass(slots=True)
class LedgerEntry:
    """One token as the brain saw it.

    token_id: id in the model's vocabulary.
    text: its decoded text (decoded within its span, so leading spaces survive).
    source: where it came from (one of SOURCES).
    tick_born / tick_died: tick it entered / left the context (tick_died None while live).
    brightness: the latest brightness the maintenance loop gave it.
    state: one of STATES.
    replaced_by: ledger ids of the tokens that replaced it (REPLACED only), else empty.
    position: the RoPE position it held when it left the context (None while live: the
        live map holds it); a resurrected token comes back there.
    resurrections: how many times it came back after being culled.
    pinned: never evicted or repaired while live.
    """

    token_id: int
    text: str
    source: str
    tick_born: int
    brightness: float
    state: str = LIVE
    tick_died: int | None = None
    replaced_by: list[int] = field(default_factory=list)
    position: int | None = None
    resurrections: int = 0
    pinned: bool = False


class Ledger:
    """Append-only list of LedgerEntry; the index of an entry is its ledger id."""

    def __init__(self, entries: list[LedgerEntry] | None = None):
        self.entries: list[LedgerEntry] = entries if entries is not None else []

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, ledger_id: int) -> LedgerEntry:
        return self.entries[ledger_id]

    def add(self, token_id: int, text: str, source: str, tick: int, brightness: float) -> int:
        """Record a new live token and return its ledger id."""
        if source not in SOURCES:
            raise ValueError(f"unknown token source {source!r}; expected one of {SOURCES}")
        self.entries.append(LedgerEntry(token_id, text, source, tick, brightness))
        return len(self.entries) - 1

    def truncate(self, length: int) -> None:
        """Forget the entries added after the ledger had `length` (the undo of a failed edit's adds)."""
        del self.entries[length:]

    def retire(self, ledger_id: int, tick: int, position: int | None = None) -> None:
        """Mark a live token as culled (it left the context without a replacement) from
        RoPE position `position`."""
        entry = self.entries[ledger_id]
        if entry.state != LIVE:
            raise ValueError(f"ledger id {ledger_id} is {entry.state}, not live")
        entry.state = CULLED
        entry.tick_died = tick
        entry.position = position

    def resurrect(self, ledger_id: int, brightness: float) -> None:
        """Bring a culled token back to life (at its recorded position, which the live map takes)."""
        entry = self.entries[ledger_id]
        if entry.state != CULLED or entry.position is None:
            raise ValueError(f"ledger id {ledger_id} is {entry.state}"
                             f"{'' if entry.position is not None else ' without a position'}; only a culled token can come back")
        entry.state, entry.tick_died, entry.position = LIVE, None, None
        entry.resurrections += 1
        entry.brightness = brightness

    def link_replacement(self, old_ids: list[int], new_ids: list[int]) -> None:
        """Turn culled tokens into tokens replaced by `new_ids`."""
        for ledger_id in old_ids:
            entry = self.entries[ledger_id]
            if entry.state != CULLED:
                raise ValueError(f"ledger id {ledger_id} is {entry.state}; only a culled token can be replaced")
            entry.state = REPLACED
            entry.replaced_by = list(new_ids)

    def count(self, state: str) -> int:
        return sum(1 for entry in self.entries if entry.state == state)
