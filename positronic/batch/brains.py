"""Several brains that tick together: continuous batching of whole brains.

    batch = Batch()
    batch.join("a", Brain.start(lm, prompt_a, config))
    batch.join("b", Brain.start(lm, prompt_b, config))
    for _ in range(100):
        records = batch.step()          # {"a": TickRecord, "b": TickRecord}
    brain_a = batch.leave("a")          # ticks alone again

A brain whose settings Core v4 runs (docs/core.md) takes a seat in an engine at its first tick
in the batch beside another of its kind (seats.py) and stays there: its ticks are rounds of batched tensor work, every
seated sequence's tick in one, and it comes back into its Brain when it leaves or when the
brains are read (`brains`), as if it had made those ticks itself. Every other brain (a
repairer, a 4-bit format, the ring store, probes; or all of them with `engine=False`) ticks
exactly as it runs alone with one difference: the model forwards of all of them are one. Those
ticks run in the thread that called `step`, each a greenlet that pauses at its forwards
(`Rounds`, rounds.py, which says why not a thread each). Brains join and leave between ticks;
a brain that fails rebuilds itself from its mirror as it would alone, and the others go on.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Hashable

from ..brain.loop import Brain, TickRecord
from .engine import Engine
from .rounds import Rounds
from .seats import Seats


class Batch:
    """Brains of one model, ticked together (see the module docstring). `engine`: seat the
    brains Core v4 runs in engines of `slots` sequences (each engine one round a tick);
    `compiled`: each engine's forward one compiled graph (positronic/models/compiled.py);
    `texts`: a round's records name the rows it took out with their texts, as a Brain's tick
    does (a decode a row: a run's edit log wants them, a batch's rounds need not pay for it)."""

    def __init__(self, *, engine: bool = True, slots: int = 16, compiled: bool = False, texts: bool = False):
        self.texts = texts
        self._brains: dict[Hashable, Brain] = {}
        self.meeting = Rounds()
        self.seats = Seats(slots=slots, compiled=compiled) if engine else None
        self._seated: dict[Hashable, Engine] = {}

    def __len__(self) -> int:
        return len(self._brains)

    @property
    def brains(self) -> dict[Hashable, Brain]:
        """Every brain, up to date: seated ones are handed back first (they take a seat again
        at the next `step`, which costs a copy of their rows each way)."""
        self.stand()
        return dict(self._brains)

    def stand(self) -> None:
        """Hand every seated brain back (`Engine.hand_back`): each is up to date, and sits again at
        the next `step`."""
        for name in list(self._seated):
            self._stand(name)

    @property
    def seated(self) -> list[Hashable]:
        """The sequences whose ticks are engine rounds now."""
        return list(self._seated)

    def join(self, name: Hashable, brain: Brain) -> None:
        """Add a started brain (between ticks). ValueError if the name is taken or the brain
        runs another model (one forward feeds one model)."""
        if name in self._brains:
            raise ValueError(f"a sequence named {name!r} is already in the batch")
        if self._brains and brain.state.lm is not next(iter(self._brains.values())).state.lm:
            raise ValueError(f"sequence {name!r} runs another model than the batch's: a batched forward feeds one model")
        self._brains[name] = brain

    def leave(self, name: Hashable) -> Brain:
        """Take a brain out (between ticks); it ticks alone again. KeyError if absent."""
        if name in self._seated:
            self._stand(name)
        return self._brains.pop(name)

    def step(self, force: dict[Hashable, int] | None = None) -> dict[Hashable, TickRecord | Exception]:
        """One tick of every brain (`force`: a token to add instead of sampling, by name, as
        `Brain.step`). Returns each brain's TickRecord, or the exception its tick raised (the
        others' ticks are not affected). KeyError for a name not in the batch and ValueError
        for a forced token outside the vocabulary, before anything ticks."""
        force = force or {}
        if unknown := set(force) - set(self._brains):
            raise KeyError(f"no sequence named {sorted(map(str, unknown))[0]} in the batch")
        if self._brains:
            vocab = next(iter(self._brains.values())).state.lm.vocab_size
            for name, token in force.items():
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                    raise ValueError(f"sequence {name!r}: a forced token is an id in 0..{vocab - 1}, got {token!r}")
        self._sit()
        records: dict[Hashable, TickRecord | Exception] = {}
        for engine in {id(engine): engine for engine in self._seated.values()}.values():
            records |= self._round(engine, force)
        alone = [name for name in self._brains if name not in self._seated]
        if len(alone) == 1:  # nothing to share a forward with: the tick as alone
            try:
                records[alone[0]] = self._brains[alone[0]].step(force.get(alone[0]))
            except Exception as error:
                records[alone[0]] = error
        elif alone:
            records |= self.meeting.run({name: functools.partial(self._brains[name].step, force.get(name))
                                         for name in alone})
        return {name: records[name] for name in self._brains}

    def warm(self) -> int:
        """Make, before the first `step`, the engines the brains not seated yet will sit in and,
        where they are compiled, every graph of theirs (a minute or so for a 135M model on a
        2-core CPU, rather than in the first ticks). Returns the graphs made."""
        if self.seats is None or not self.seats.compiled:
            return 0
        made = 0
        for name, brain in self._brains.items():
            if name not in self._seated and (engine := self.seats.engine_for(brain)) is not None and not len(engine):
                made += engine.warm(brain.config)
        return made

    def _sit(self) -> None:
        """Every brain not seated that an engine can take joins one, where it has company
        there (a brain of its kind seated or standing: an eager engine round of one is slower
        than the brain's own tick on a 2-core CPU, 2.1 against 2.0 ms on random:tiny), or alone
        where the engines are compiled (a compiled round of one is faster: 1.1 ms there, 30-34
        against 47-53 ms on SmolLM2); an engine made now gets room for the largest budget among
        the brains of its kind still standing."""
        if self.seats is None or len(self._seated) == len(self._brains):
            return
        company = Counter(self.seats.kind(self._brains[name]) for name in self._seated)
        waiting: dict[tuple, list[Hashable]] = {}
        for name, brain in self._brains.items():
            if name not in self._seated and self.seats.refusal(brain) is None:
                waiting.setdefault(self.seats.kind(brain), []).append(name)
        for kind, names in waiting.items():
            if len(names) + company[kind] < (1 if self.seats.compiled else 2):
                continue
            widest = max(self._brains[name].config.budget for name in names)
            for name in names:
                engine = self.seats.engine_for(self._brains[name], capacity=widest)
                if engine is not None:
                    engine.join(name, self._brains[name])
                    self._seated[name] = engine

    def _stand(self, name: Hashable) -> None:
        """Seated `name` comes back into its Brain (Engine.hand_back)."""
        engine = self._seated.pop(name)
        engine.hand_back(name, self._brains[name])
        self.seats.drop_empty()

    def _round(self, engine: Engine, force: dict[Hashable, int]) -> dict[Hashable, TickRecord | Exception]:
        """One round of `engine`: its sequences' TickRecords (a sequence whose round failed was
        rebuilt from its mirror: rebuilt, as a Brain's failed tick)."""
        given = {name: (force[name], "generated") for name in engine.keys() if name in force}
        for name in engine.keys():  # a line said to a seated brain: its next token, as its own tick reads it
            if name not in given and (typed := self._brains[name].pending_input):
                given[name] = (typed[0], "user")
        previous = Seats.last_tokens(engine)
        for sequence in engine.sequences:  # a grammar set or cleared on the brain since it sat down
            sequence.constraint = self._brains[sequence.key].constraint
        try:
            made = engine.step(given)
        except Exception as error:  # refused before anything changed
            return {name: error for name in engine.keys()}
        for name, (_, source) in given.items():
            if source == "user" and name in made:  # in: it leaves the brain's queue (not when the round failed)
                self._brains[name].input_added()
        records = Seats.records(engine, made, previous, {name: source for name, (_, source) in given.items()},
                                texts=self.texts)
        for name, record in records.items():  # seated, every observer takes rounds (Seats.refusal)
            for observer in self._brains[name].observers:
                observer.round(self._brains[name], record)
        return records
