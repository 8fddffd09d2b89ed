"""Seats in Core v4's engines: which engine a brain's ticks run in, and what a round did for it.

    seats = Seats(slots=16)
    engine = seats.engine_for(brain)          # None: it ticks on its own brain
    engine.join(key, brain)
    made = engine.step()
    record = seats.record(engine, key, made.get(key), previous=..., source="generated")

Engines are made as brains need them, one set per kind: the model, the layers whose attention
is recorded, and the lanes (shared rows, or SmartKV's with its gates). A brain takes a seat in
an engine of its kind with a free slot and room for its budget; where none has both, a new
engine is made with `capacity` rows a sequence (its budget unless the caller asks for more, so
that sequences of several budgets share one round). `Batch` and the server's worker both seat
their brains here.
"""

from __future__ import annotations

from collections.abc import Hashable

from positronic.steps.attention import layer_indices

from ..brain.loop import TickRecord
from ..models.compiled import refusal as compiled_refusal
from ..text import span_texts
from .engine import Engine, unsupported


class Seats:
    """Engines of `slots` sequences each, made as brains need them (module docstring).
    `smartkv`: whether SmartKV brains (lanes apart) take seats at all; `compiled`: the engines'
    forwards as compiled graphs (positronic/models/compiled.py; a model it cannot run ticks
    its brains on their own, the reason in `refusal`)."""

    def __init__(self, *, slots: int, smartkv: bool = True, compiled: bool = False):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a whole number of at least 1, got {slots!r}")
        self.slots, self.smartkv, self.compiled = slots, smartkv, compiled
        self._engines: dict[tuple, list[Engine]] = {}

    @property
    def engines(self) -> list[Engine]:
        return [engine for group in self._engines.values() for engine in group]

    @property
    def rounds(self) -> int:
        """Rounds the engines have run (each one token for every sequence in it)."""
        return sum(engine.rounds for engine in self.engines)

    def kind(self, brain) -> tuple:
        """What must be alike for two brains to share an engine."""
        config, lm = brain.config, brain.state.lm
        lanes = ("smartkv", config.gates) if brain.state.per_layer else "shared"
        return id(lm), tuple(layer_indices(config.recorded_layers, lm.num_layers)), lanes

    def refusal(self, brain) -> str | None:
        """Why `brain` takes no seat (its ticks stay its own), or None."""
        config = brain.config
        if config.policy == "none" and config.at_capacity == "stop":
            return "policy none stops at capacity: its last tick ends it, in its own brain"
        if (reason := unsupported(brain)) is not None:  # before any engine's buffers are made for it
            return reason
        if any(not getattr(observer, "sees_rounds", False) for observer in brain.observers):
            return "an observer of its ticks (a fixture capture) sees each action list as its own tick applies it"
        if brain.state.per_layer and not self.smartkv:
            return "smartkv brains tick on their own here"
        if self.compiled and (reason := compiled_refusal(brain.state.lm)) is not None:
            return reason
        return None

    def engine_for(self, brain, *, capacity: int | None = None) -> Engine | None:
        """The engine `brain` joins (an existing one of its kind with a free slot and room for
        its budget, else a new one of `capacity` rows a sequence, at least its budget), or None
        where it takes no seat (`refusal`)."""
        if self.refusal(brain) is not None:
            return None
        kind = self.kind(brain)
        group = self._engines.setdefault(kind, [])
        for engine in group:
            if engine.refusal(brain, returning=True) is None:
                return engine
        layers = brain.state.mirror.layers  # lanes apart (SmartKV): made with its lanes, so a warmed one stays
        engine = Engine(brain.state.lm, slots=self.slots, capacity=max(capacity or 0, brain.config.budget),
                        score_layers=list(kind[1]), compiled=self.compiled,
                        lanes=None if layers is None else layers.num_layers)
        if engine.refusal(brain, returning=True) is not None:
            return None
        group.append(engine)
        return engine

    def drop_empty(self) -> None:
        """Let go of engines nobody sits in (their buffers are freed)."""
        for kind, group in list(self._engines.items()):
            group[:] = [engine for engine in group if len(engine)]
            if not group:
                del self._engines[kind]

    @staticmethod
    def last_tokens(engine: Engine) -> dict[Hashable, int]:
        """Each sequence's newest token (the text of the next one is decoded after it)."""
        state, active = engine.state, len(engine)
        if not active:
            return {}
        rows = (state.length[:active] - 1).clamp(min=0)
        newest = state.token_ids[range(active), 0, rows].tolist()  # one copy for every sequence
        return dict(zip(engine.keys(), newest))

    @staticmethod
    def record(engine: Engine, key: Hashable, token: int | None, *, source: str = "generated",
               previous: int | None = None) -> TickRecord:
        """What the engine's last round did for sequence `key` as a Brain's TickRecord: the
        token (None: its round failed and it was rebuilt from its mirror, adding nothing), its
        text when `previous` (the token before it) is given, the rows it deleted (lane 0's, as
        delete actions), its tick and live length. A round keeps no brightness per tick (the
        brain's ledger has it again once it leaves): the record's brightness fields are 0."""
        slot = engine.keys().index(key)
        return _record(engine, slot, key, token, source, previous, engine.lengths[key])

    @staticmethod
    def records(engine: Engine, made: dict[Hashable, int], previous: dict[Hashable, int],
                sources: dict[Hashable, str] | None = None, *, texts: bool = False) -> dict[Hashable, TickRecord]:
        """`record` of every sequence of the engine's last round (`sources`: the ledger source of
        those given a token, "user" for typed input; the others' "generated"), the live lengths
        the engine read in one copy. `texts`: each record's `removed` too, where rows are shared (a decode
        a row: what a run's edit log shows; a batch's rounds skip it)."""
        sources = sources or {}
        return {key: _record(engine, slot, key, made.get(key), sources.get(key, "generated"), previous.get(key),
                             engine.lengths[key], texts=texts)
                for slot, key in enumerate(engine.keys())}


def _record(engine: Engine, slot: int, key: Hashable, token: int | None, source: str, previous: int | None,
            length: int, *, texts: bool = False) -> TickRecord:
    rows = engine.removed.get(key, []) if token is not None else []
    text = "" if token is None or previous is None else span_texts(engine.lm.decode, [token], previous)[0]
    actions = [{"action": "delete", "position": row} for row in sorted(rows)]  # in row order, as the policies list them
    removed = []
    if texts and token is not None and engine.state.lanes == 1:
        # shared rows: the deleted ones are tokens out of the context; their ledger ids are the
        # mirror's, made when it is read (docs/core.md, "The mirrors")
        removed = [{"ledger_id": None, "text": engine.lm.decode([t])} for t in engine.removed_tokens.get(key, [])]
    elif texts and rows:  # lanes apart: each lane's own drops, as a Brain's tick lists them
        dropped = [[] for _ in range(engine.state.lanes)]
        for lane, row in engine.deleted[slot].nonzero().tolist():
            dropped[lane].append(row)
        actions = [{"action": "drop", "rows": dropped}]
    return TickRecord(tick=engine.state.tick(slot), token_id=-1 if token is None else token, text=text,
                      actions=actions + ([] if token is None else [{"action": "add", "token_id": token}]),
                      removed=removed,
                      outcomes=[], live_length=length, brightness_min=0.0, brightness_mean=0.0, brightness_max=0.0,
                      rebuilt=token is None, source=source,
                      complete=token is not None and (constraint := engine.sequences[slot].constraint) is not None
                      and constraint.done,
                      error=None if token is not None else "the engine's round failed: rebuilt from the mirror")
