"""The state: the KV cache and the mirror, changed together by one writer, the StateManager.

    manager.py      StateManager: apply an edit (plan → splice → rotate → one forward → commit), rebuild
    edit.py         Edit: an action list checked once, in typed parts (Bounds: what it is checked against)
    actions.py      the action dicts (the wire format of an edit at the edges) and ActionError
    rows.py         how an edit moves the cache's rows: SharedRows, LaneRows (per-layer rows)
    forward.py      every model forward over the cache
    view.py         ContextView / RowReader: what policies read
    checks.py       cache and mirror agree; layer-0 tolerances; divergence
    persistence.py  saving and resuming (from_saved, tensors)
    faults.py       test-only fault injection
"""

from .actions import ActionError
from .checks import StateInvariantError, rounding_bounds
from .edit import Bounds, Edit
from .faults import FAULT_STAGES, InjectedFault
from .manager import ApplyReport, StateBrokenError, StateManager, default_capacity
from .persistence import lane_counts
from .view import ContextView, RowReader

__all__ = [
    "FAULT_STAGES", "ActionError", "ApplyReport", "Bounds", "ContextView", "Edit", "InjectedFault", "RowReader",
    "StateBrokenError", "StateInvariantError", "StateManager", "default_capacity", "lane_counts", "rounding_bounds",
]
