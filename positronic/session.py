"""Sessions: a run's mirror, settings and sampler state saved with msgpack, and resumed.

A checkpoint first rebuilds the cache from the mirror (a fidelity refresh), so the saved
mirror alone reproduces the running state exactly: a resumed run continues token for token
as the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import mirror
import steps

from .loop import Brain, BrainConfig, cache_capacity
from .state_manager import StateManager

MIRROR_FILE = "mirror.msgpack"


class SessionError(ValueError):
    """A session directory that cannot be saved to or resumed from."""


def save(directory: str | Path, brain: Brain, model_name: str) -> Path:
    """Checkpoint `brain` into `directory` (created if needed); atomic."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    brain.state.rebuild(count=False)
    meta = {
        "model": model_name,
        "tick": brain.tick,
        "config": dataclasses.asdict(brain.config),
        "generator": bytes(brain.generator_state().numpy().tobytes()),
        "counts": dict(brain.counts),
    }
    path = directory / MIRROR_FILE
    mirror.save(path, brain.state.mirror, meta)
    for stale in directory.glob(MIRROR_FILE + ".*.tmp"):  # left by a save that was killed
        stale.unlink(missing_ok=True)
    return path


# Settings added after sessions were first saved, with the values those runs used: a session
# saved before them resumes exactly as it would have gone on, not with today's defaults.
BEFORE_NEW_SETTINGS = {"ttl_decay": 2.0, "ttl_gain": 10.0, "unit": 2, "bridge_margin": 0.0}


def checked_config(path: Path, config) -> dict:
    """The saved settings, complete and of the right types, or SessionError naming what is not
    (a missing budget must not silently become the default, a string must not reach the loop)."""
    fields = {f.name: f for f in dataclasses.fields(BrainConfig)}
    if not isinstance(config, dict):
        raise SessionError(f"{path}: settings missing")
    if unknown := sorted(set(config) - set(fields)):
        raise SessionError(f"{path}: unknown settings: {unknown}")
    config = {**BEFORE_NEW_SETTINGS, **config}
    if missing := sorted(set(fields) - set(config)):
        raise SessionError(f"{path}: settings missing: {missing}")
    for name, value in config.items():
        default = fields[name].default
        if name == "score_layers":
            ok = value in ("last", "all") or (isinstance(value, list) and all(type(v) is int for v in value))
        elif type(default) is float:
            ok = type(value) in (int, float)
        else:
            ok = type(value) is type(default)
        if not ok:
            raise SessionError(f"{path}: setting {name} has the wrong type: {value!r}")
    try:
        BrainConfig(**config).validate()
    except ValueError as exc:
        raise SessionError(f"{path}: {exc}") from None
    return config


def load(directory: str | Path) -> tuple[mirror.Mirror, dict]:
    """The saved mirror and its metadata, validated."""
    path = Path(directory) / MIRROR_FILE
    if not path.is_file():
        raise SessionError(f"{directory}: no saved session ({MIRROR_FILE} missing)")
    saved, meta = mirror.load(path)
    meta["config"] = checked_config(path, meta.get("config"))
    if type(meta.get("tick")) is not int or meta["tick"] < 0 or not isinstance(meta.get("model"), str):
        raise SessionError(f"{path}: tick or model missing")
    if not isinstance(meta.get("generator"), bytes):
        raise SessionError(f"{path}: sampler state missing")
    return saved, meta


def resume(lm, directory: str | Path) -> Brain:
    """Rebuild the cache from the saved mirror and return a Brain that continues the run."""
    saved, meta = load(directory)
    if meta["model"] != lm.name:
        raise SessionError(f"{directory}: saved with model {meta['model']!r}, not {lm.name!r}")
    config = BrainConfig(**meta["config"])
    state = StateManager.from_mirror(lm, saved, capacity=cache_capacity(len(saved), config.budget),
                                     score_layers=config.score_layers, brightness=steps.RULES[config.brightness].start)
    generator_state = torch.frombuffer(bytearray(meta["generator"]), dtype=torch.uint8)
    brain = Brain(state, config, tick=meta["tick"], generator_state=generator_state)
    brain.counts.update({k: v for k, v in meta.get("counts", {}).items() if k in brain.counts})
    return brain
