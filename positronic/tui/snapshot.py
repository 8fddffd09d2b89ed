"""The snapshot: everything one frame of the live view shows, copied out of the brain.

rich's `Live` redraws from its own thread while the tick loop mutates the mirror in the main
thread, so the render thread never reads the brain: the loop thread calls `take_snapshot`
at a tick boundary and the frame is drawn from that immutable copy of plain Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from positronic import steps

if TYPE_CHECKING:  # imported for annotations only: the loop module pulls in torch
    from ..brain.loop import Brain
    from ..models import LoadedModel


@dataclass(frozen=True)
class Snapshot:
    """Everything one frame shows, copied out of the brain at a tick boundary."""

    model: str
    device: str
    dtype: str
    policy: str
    rule: str
    tick: int  # the brain's tick (continues across resumes)
    done: int  # ticks run by this invocation
    total: int | None  # ticks this invocation will run (None: no limit)
    texts: list[str]  # per live row, in cache order
    brightness: list[float]
    sources: list[str]
    born: list[int]  # tick each live row entered the context
    budget: int
    sinks: int
    protect: int
    window: int
    bright_max: float  # top of the colour scale (the rule's start value)
    counts: dict[str, int]
    cache_mb: float
    tok_s: float
    elapsed: float
    actions: list[str]  # newest last
    status: str = "running"  # running | finished | interrupted | policy stopped
    resumed: bool = False
    pending_input: int = 0  # typed tokens queued and not added yet
    input_note: str = ""  # why the last line was refused, while it is recent
    recalled: list[bool] = field(default_factory=list)  # per live row: recall brought it back
    pinned: list[bool] = field(default_factory=list)  # per live row: pinned (never evicted)
    restored: int | None = None  # rows recall brought back so far (None: recall is off)
    # "brightness", or "layers" when layers keep different rows (policy smartkv): then the colour
    # and the histogram show how many of the model's layers hold each token (0..bright_max)
    measure: str = "brightness"
    rows_per_layer: int | None = None  # per-layer rows: what the budget bounds (texts: the union)


def shades(brain: "Brain", num_layers: int) -> tuple[list[float], float, str]:
    """What the live view colours each live token by: (values in live order, their full scale,
    the measure's name). Brightness; or, where layers keep rows of their own (SmartKV, which
    keeps no brightness), how many layers (or kv heads: per-head rows) still hold each token."""
    mirror = brain.state.mirror
    if mirror.layers is not None:
        measure = "layers" if mirror.layers.num_layers == num_layers else "kv heads"
        return [float(n) for n in mirror.layers.occupancy(mirror.live.ledger_ids)], float(mirror.layers.num_layers), measure
    return [float(b) for b in mirror.brightness()], float(steps.RULES[brain.config.brightness].start), "brightness"


def take_snapshot(brain: "Brain", lm: "LoadedModel", *, done: int = 0, total: int = 0, tok_s: float = 0.0,
                  elapsed: float = 0.0, actions: list[str] | None = None, status: str = "running",
                  resumed: bool = False, input_note: str = "") -> Snapshot:
    """Copy what a frame needs out of the brain (one pass over the live rows)."""
    mirror, cfg = brain.state.mirror, brain.config
    entries = mirror.ledger.entries
    rows = [entries[i] for i in mirror.live.ledger_ids]
    shown, scale, measure = shades(brain, lm.num_layers)
    return Snapshot(
        model=lm.name, device=str(lm.device), dtype=str(lm.dtype).removeprefix("torch."), policy=cfg.policy,
        rule=cfg.brightness, tick=brain.tick, done=done, total=total,
        texts=[e.text for e in rows], brightness=shown, measure=measure,
        rows_per_layer=None if mirror.layers is None else len(mirror.layers),
        sources=[e.source for e in rows], born=[e.tick_born for e in rows],
        budget=cfg.budget, sinks=cfg.sinks, protect=cfg.protect, window=cfg.window,
        bright_max=scale, counts=dict(brain.counts),
        cache_mb=brain.state.cache.memory_usage_mb(), tok_s=tok_s, elapsed=elapsed,
        actions=list(actions or ()), status=status, resumed=resumed,
        pending_input=len(brain.pending_input), input_note=input_note,
        recalled=[e.resurrections > 0 for e in rows], pinned=[e.pinned for e in rows],
        restored=None if brain.policy.recall is None else brain.policy.recall.restored)
