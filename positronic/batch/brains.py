"""Several brains that tick together: continuous batching of whole brains.

Every sequence is a `Brain` of its own (its cache, mirror, ledger, policy and policy state,
budget, pins, recall memory, sampler and seed), so a tick of the batch is each brain's tick
exactly as it runs alone, with one difference: the model forwards of all of them are one
(`Rendezvous`), run in the thread that called `step`. Brains join and leave between ticks; a
brain that fails rebuilds itself from its mirror as it would alone, and the others go on.

    batch = Batch()
    batch.join("a", Brain.start(lm, prompt_a, config))
    batch.join("b", Brain.start(lm, prompt_b, config))
    for _ in range(100):
        records = batch.step()          # {"a": TickRecord, "b": TickRecord}
    brain_a = batch.leave("a")          # ticks alone again
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from ..brain.loop import Brain, TickRecord
from ..state.forward import MEETING
from .rendezvous import Rendezvous
from .threads import one_thread


class Batch:
    """Brains of one model, ticked together (see the module docstring)."""

    def __init__(self):
        self.brains: dict[Hashable, Brain] = {}
        self.meeting = Rendezvous()

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
        others' ticks are not affected)."""
        force = force or {}
        if unknown := set(force) - set(self.brains):
            raise KeyError(f"no sequence named {sorted(map(str, unknown))[0]} in the batch")
        records: dict[Hashable, TickRecord | Exception] = {}
        names = list(self.brains)

        def tick(name: Hashable) -> None:
            MEETING.set(self.meeting)  # this thread's forwards meet the others', in the caller's thread
            try:
                with one_thread(cores):
                    records[name] = self.brains[name].step(force.get(name))
            except Exception as error:
                records[name] = error
            finally:
                self.meeting.done()

        if len(names) == 1:  # nothing to share a forward with: the tick as alone, in this thread
            try:
                return {names[0]: self.brains[names[0]].step(force.get(names[0]))}
            except Exception as error:
                return {names[0]: error}
        self.meeting.expect(len(names))
        cores = torch.get_num_threads()  # this thread's, which runs their forwards
        threads = [threading.Thread(target=tick, args=(name,), name=f"tick {name}") for name in names]
        started = []

        def start() -> None:
            for thread in threads:
                thread.start()
                started.append(thread)

        try:
            self.meeting.serve(starting=start)  # their forwards run in this thread (rendezvous.py says why)
        finally:
            for thread in started:
                thread.join()
        return {name: records[name] for name in names}
