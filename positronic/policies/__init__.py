"""Maintenance policies: what to take out of the context each tick (docs/policies.md).

One module per policy on the shared framework of base.py (scorer, unit, window, batch; the one
selector and protected-rows rule; the plan → commit protocol):

    brightness  the halo rules (ttl / vote), pairs, repaired by the run's repairer
    streaming   sinks + recent window; the oldest middle rows go (StreamingLLM, --kv-eviction 1)
    scored      the least recently attended rows go (llama.cpp --kv-eviction 2)
    h2o         the rows with the least accumulated attention go (Heavy-Hitter Oracle)
    none        never evict: at capacity stop, or do llama.cpp's context shift
    random      uniformly random selectable rows go, drawn from the run's seed (the baseline papers report)
    smartkv     per-layer rows: each layer keeps its own gate-ranked memory (registered by
                positronic/smartkv/policy.py, which imports this package, never the other way)
    knorm, ...  a press (positronic/presses/) without a policy of its own, ticking one sequence
                (pressed.py): `presses.register` adds one

`POLICIES` maps a name to its class; `register` adds one (a class with `name`, `check`,
`window`, `batch`, `default_window`, `per_layer`, `plan`, `prune`, `commit`, `state`,
`load_state`); the CLI's --policy choices and `BrainConfig.validate` read it.
"""

from __future__ import annotations

from .base import DEFAULT_WINDOW, Policy, PolicyPlan, batch_size, pinned_rows, recent_window
from .brightness import BrightnessPolicy
from .h2o import H2OPolicy
from .none import NoEvictionPolicy
from .random import RandomPolicy
from .scored import ScoredPolicy
from .streaming import StreamingPolicy

POLICIES: dict[str, type] = {}


def register(policy: type) -> type:
    """Make `policy` available as `--policy <policy.name>` (usable as a class decorator)."""
    if POLICIES.get(policy.name, policy) is not policy:
        raise ValueError(f"policy {policy.name!r} is already registered")
    POLICIES[policy.name] = policy
    return policy


for _policy in (BrightnessPolicy, StreamingPolicy, ScoredPolicy, H2OPolicy, NoEvictionPolicy, RandomPolicy):
    register(_policy)


def reads_window(name: str) -> bool:
    """Whether policy `name` reads the configured window (its class defines `window` itself,
    not llama.cpp's rule of the shared base; a policy made from a press: whether the press does)."""
    cls = POLICIES.get(name, object)
    return "window" in vars(getattr(cls, "press_class", cls))


def window_refusal(name: str) -> str:
    """Why a window given to policy `name` (one that does not read it) is refused."""
    *others, last = [n for n in POLICIES if reads_window(n)]
    readers = f"{', '.join(others)} and {last}" if others else last
    kept = ("evicts nothing, so it has no recent window" if name == "none"
            else "keeps llama.cpp's recent window, max(32, live length / 4)")
    return f"window sets the recent rows of policies {readers}; policy {name} {kept} (leave the window out)"


def make_policy(name: str, lm, config):
    """The policy `name` for a run of `lm` with `config`."""
    try:
        return POLICIES[name](lm, config)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None


__all__ = ["DEFAULT_WINDOW", "POLICIES", "BrightnessPolicy", "H2OPolicy", "NoEvictionPolicy", "Policy", "PolicyPlan",
           "RandomPolicy", "ScoredPolicy", "StreamingPolicy", "batch_size", "make_policy", "pinned_rows",
           "reads_window", "recent_window", "register", "window_refusal"]
