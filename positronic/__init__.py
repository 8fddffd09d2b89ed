"""Positronic Brain: continuous inference with a KV cache kept inside a fixed budget.

    from positronic import load_model, StateManager
    lm = load_model("smollm2")
    sm = StateManager.from_tokens(lm, [lm.bos_id] + lm.encode("Once upon a time"))
    report = sm.apply([{"action": "add", "token_id": 42}])

    brain = Brain.start(lm, [lm.bos_id] + lm.encode("Once upon a time"), BrainConfig(budget=128))
    record = brain.step()                  # one tick: sample, score, select, apply
"""

from .state.actions import ActionError
from .kv.cache import SpliceCache, SpliceLayer
from .models import LoadedModel, ModelError, ModelNotAvailable, load_model, with_cache
from .smartkv import GateSet, SmartKVCache
from .state import ApplyReport, InjectedFault, StateInvariantError, StateManager
from .batch.generate import press
from .batch import Batch
from .brain.loop import Brain, BrainConfig, TickRecord

__all__ = [
    "ActionError", "ApplyReport", "Batch", "Brain", "BrainConfig", "GateSet", "InjectedFault", "LoadedModel", "ModelError", "ModelNotAvailable",
    "SmartKVCache", "SpliceCache", "SpliceLayer", "StateInvariantError", "StateManager", "TickRecord", "load_model",
    "press", "with_cache",
]
