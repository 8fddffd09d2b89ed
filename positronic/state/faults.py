"""Fault injection, for tests: make the next edit fail at a chosen stage, to show a tick
happens entirely or not at all.

The StateManager calls two cheap hooks on its edit path: `point(stage)` after each stage and
`forward()` around its forward. Normally they belong to `NO_FAULTS` and do nothing; `arm`
returns a `Fault` that raises `InjectedFault` once, at its stage, and is spent after that.
"""

from __future__ import annotations

import contextlib

from .forward import FEEDING

FAULT_STAGES = ("splice", "rotate", "forward", "mid-forward", "commit")


class InjectedFault(RuntimeError):
    """Raised on purpose by `StateManager.inject_fault`, to test recovery."""


class NoFaults:
    """The hooks of a state with no fault armed: nothing happens."""

    def point(self, stage: str) -> None:
        """Called after stage `stage` of an edit (splice, rotate, forward) and before the commit."""

    def forward(self):
        """Entered around the edit's forward."""
        return contextlib.nullcontext()


NO_FAULTS = NoFaults()


class Fault(NoFaults):
    """Raises InjectedFault once: at `point(stage)`, or with stage 'mid-forward' in the middle
    layer of the next forward (after some layers wrote their rows)."""

    def __init__(self, lm, stage: str, cache=None):
        if stage not in FAULT_STAGES:
            raise ValueError(f"unknown fault stage {stage!r}; choose from {', '.join(FAULT_STAGES)}")
        self.lm, self.stage, self.cache = lm, stage, cache  # cache: the faulty sequence's, in a batched forward

    def point(self, stage: str) -> None:
        if self.stage == stage:
            self.stage = None
            raise InjectedFault(f"fault injected at stage {stage!r}")

    def forward(self):
        if self.stage != "mid-forward":
            return contextlib.nullcontext()
        self.stage = None
        return self._armed(self.lm.model.model.layers[self.lm.num_layers // 2], id(self.cache))

    @staticmethod
    @contextlib.contextmanager
    def _armed(middle, cache: int):
        def explode(module, args):
            feeding = FEEDING.get()  # a batched forward: only one that feeds this sequence fails
            if feeding is None or cache in feeding:
                raise InjectedFault("fault injected half-way through the forward")

        handle = middle.register_forward_pre_hook(explode)
        try:
            yield
        finally:
            handle.remove()
