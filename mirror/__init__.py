"""Metadata side of the brain: the ledger of every token and the live map of cache rows.

Pure Python; no torch. See README "State model".
"""

from .ledger import CULLED, LIVE, REPLACED, SOURCES, STATES, Ledger, LedgerEntry
from .layout import Insertion, Layout, plan_layout
from .live_map import LiveMap
from .mirror import Mirror, MirrorInvariantError
from .storage import MirrorFileError, from_bytes, load, save, stale_temporaries, to_bytes, write_atomic

__all__ = [
    "CULLED", "LIVE", "REPLACED", "SOURCES", "STATES",
    "Insertion", "Layout", "Ledger", "LedgerEntry", "LiveMap", "Mirror", "MirrorInvariantError",
    "MirrorFileError", "from_bytes", "load", "plan_layout", "save", "stale_temporaries", "to_bytes", "write_atomic",
]
