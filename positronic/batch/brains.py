"""Several brains that tick together: continuous batching of whole brains.

Every sequence is a `Brain` of its own (its cache, mirror, ledger, policy and policy state,
budget, pins, recall memory, sampler and seed), so a tick of the batch is each brain's tick
exactly as it runs alone, with one difference: the model forwards of all of them are one.
The ticks run in the thread that called `step`, each a greenlet that pauses at its forwards
(`Rounds`, rounds.py, which says why not a thread each). Brains join and leave between ticks; a
brain that fails rebuilds itself from its mirror as it would alone, and the others go on.

    batch = Batch()
    batch.join("a", Brain.start(lm, prompt_a, config))
    batch.join("b", Brain.start(lm, prompt_b, config))
    for _ in range(100):
        records = batch.step()          # {"a": TickRecord, "b": TickRecord}
    brain_a = batch.leave("a")          # ticks alone again
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

from ..brain.loop import Brain, TickRecord
from .rounds import Rounds


class Batch:
    """Brains of one model, ticked together (see the module docstring)."""

    def __init__(self):
        self.brains: dict[Hashable, Brain] = {}
        self.meeting = Rounds()

    def __len__(self) -> int:
        return len(self.brains)

    def join(self, name: Hashable, brain: Brain) -> None:
        """Add a started brain (between ticks). ValueError if the name is taken or the brain
        runs another model (one forward feeds one model)."""
        if name in self.brains:
            raise ValueError(f"a sequence named {name!r} is already in the batch")
        if self.brains and brain.state.lm is not next(iter(self.brains.values())).state.lm:
            raise ValueError(f"sequence {name!r} runs another model than the batch's: a batched forward feeds one model")
        self.brains[name] = brain

    def leave(self, name: Hashable) -> Brain:
        """Take a brain out (between ticks); it ticks alone again. KeyError if absent."""
        return self.brains.pop(name)

    def step(self, force: dict[Hashable, int] | None = None) -> dict[Hashable, TickRecord | Exception]:
        """One tick of every brain (`force`: a token to add instead of sampling, by name, as
        `Brain.step`). Returns each brain's TickRecord, or the exception its tick raised (the
        others' ticks are not affected). Every tick and every forward runs in this thread."""
        force = force or {}
        if unknown := set(force) - set(self.brains):
            raise KeyError(f"no sequence named {sorted(map(str, unknown))[0]} in the batch")
        names = list(self.brains)
        if len(names) == 1:  # nothing to share a forward with: the tick as alone
            try:
                return {names[0]: self.brains[names[0]].step(force.get(names[0]))}
            except Exception as error:
                return {names[0]: error}
        return self.meeting.run({name: functools.partial(self.brains[name].step, force.get(name)) for name in names})
