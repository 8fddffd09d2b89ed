"""Presses: the eviction policies of positronic/policies/ as batched tensor scorers over S
sequences, in the manner of kvpress's presses, on one shared selection (select.py).

A press (base.Press) scores every row of S sequences at once ([S, N] tensors, rows compact:
rows past a sequence's length are padding) and `select` deletes the lowest units, exactly as
the per-sequence policy of the same name does today (tests/positronic/presses/):

    streaming   the oldest middle rows go (StreamingLLM, llama.cpp --kv-eviction 1)
    h2o         the least accumulated attention goes (Heavy-Hitter Oracle)
    scored      the least recently accessed rows go (llama.cpp --kv-eviction 2)
    brightness  the halo rules ttl / vote, units of `unit` rows (no repairer)
    random      uniformly random selectable rows, from each sequence's own generator
    none        no eviction: stop at capacity, or llama.cpp's context shift
    knorm       the largest-norm keys go (kvpress's KnormPress): a press with no policy of its own,
                ticking alone through policies/pressed.py
    smartkv     SmartKV's memories (without recall): each lane (a layer, or a kv head of one)
                keeps its own rows, chosen by learned gates (positronic/smartkv/)

`PRESSES` maps a name to its class; `register` adds one; `make_press(name, settings)` builds
one from its settings, a mapping of them or a BrainConfig.
"""

from __future__ import annotations

from typing import Any

from .base import Plan, Press, Rows, Settings, mean_after_sinks
from .brightness import BrightnessPress, BrightnessSettings
from .h2o import H2OPress
from .knorm import KeyNormPress, KeyNormSettings
from .none import NoEvictionPress, NoEvictionSettings
from .random import RandomPress, RandomSettings
from .scored import ScoredPress
from .select import bounds, lowest_rows, select
from .smartkv import SmartKVPress, SmartKVSettings
from .streaming import StreamingPress

PRESSES: dict[str, type[Press]] = {}


def register(cls: type[Press]) -> type[Press]:
    """Make `cls` available as `make_press(cls.name, ...)` and, where no policy has its name,
    as a policy too (`--policy NAME` in run, serve and eval; its own settings by
    `--policy-option NAME=VALUE`): policies/pressed.py ticks it one sequence at a time. Usable
    as a class decorator; ValueError if another press or policy has the name."""
    from ..policies import POLICIES, register as register_policy
    from ..policies.pressed import policy_of

    _add(cls)
    if cls.name not in POLICIES:
        register_policy(policy_of(cls))
    return cls


def _add(cls: type[Press]) -> None:
    if PRESSES.get(cls.name, cls) is not cls:
        raise ValueError(f"press {cls.name!r} is already registered")
    PRESSES[cls.name] = cls


def load_entry_points() -> list[str]:
    """Register the presses other packages declare (entry point group "positronic.presses",
    each a module or a Press class: importing it registers it); their names. A command calls
    this once at start, so `pip install` is all a press package needs."""
    from importlib.metadata import entry_points

    names = []
    for point in entry_points(group="positronic.presses"):
        loaded = point.load()
        if isinstance(loaded, type) and issubclass(loaded, Press) and loaded.name not in PRESSES:
            register(loaded)
        names.append(point.name)
    return names


for _press in (StreamingPress, H2OPress, ScoredPress, BrightnessPress, RandomPress, NoEvictionPress, SmartKVPress):
    _add(_press)  # each has a policy of its own (positronic/policies/)
register(KeyNormPress)  # ticks alone through policies/pressed.py


def make_press(name: str, settings: Any) -> Press:
    """The press `name` with `settings`: its Settings, a mapping of them, or a BrainConfig."""
    try:
        cls = PRESSES[name]
    except KeyError:
        raise ValueError(f"unknown press {name!r}; choose from {', '.join(PRESSES)}") from None
    return cls(settings)


__all__ = ["PRESSES", "BrightnessPress", "BrightnessSettings", "H2OPress", "KeyNormPress", "KeyNormSettings",
           "NoEvictionPress", "NoEvictionSettings",
           "Plan", "Press", "RandomPress", "RandomSettings", "Rows", "ScoredPress", "Settings", "SmartKVPress",
           "SmartKVSettings", "StreamingPress",
           "bounds", "load_entry_points", "lowest_rows", "make_press", "mean_after_sinks", "register", "select"]
