"""Metadata side of the brain: the ledger of every token and the live map of cache rows.

Pure Python; no torch. See docs/DESIGN.md §1 "The state model".
"""

from .layer_rows import LayerRows, LayerRowsError
from .ledger import CULLED, LIVE, REPLACED, SOURCES, STATES, Ledger, LedgerEntry
from .layout import Insertion, Layout, plan_layout, runs_without
from .live_map import LiveMap
from .mirror import Mirror, MirrorInvariantError
from .ring import Ring
from .storage import (MirrorFileError, TooLarge, from_bytes, load, read_bounded, save, stale_temporaries, to_bytes,
                      to_chunks, write_atomic)

__all__ = [
    "CULLED", "LIVE", "REPLACED", "SOURCES", "STATES",
    "Insertion", "LayerRows", "LayerRowsError", "Layout", "Ledger", "LedgerEntry", "LiveMap", "Mirror", "MirrorInvariantError",
    "MirrorFileError", "Ring", "TooLarge", "from_bytes", "load", "read_bounded", "plan_layout", "runs_without", "save", "stale_temporaries", "to_bytes", "to_chunks", "write_atomic",
]
