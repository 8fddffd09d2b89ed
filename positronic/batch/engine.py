"""Core v4's decode loop: every sequence's tick as one round of batched tensor work.

    engine = Engine(lm, slots=32, capacity=256)
    engine.join("a", Brain.start(lm, prompt_a, BrainConfig(policy="h2o", budget=256, temperature=0)))
    engine.join("b", Brain.start(lm, prompt_b, BrainConfig(policy="streaming", budget=256, temperature=0)))
    for _ in range(100):
        tokens = engine.step()        # {"a": token id, "b": token id}: one round
    mirror = engine.leave("a")

A round, for the S active sequences at once (positronic/state/slots.py holds them):

1. sample: the argmax of every greedy sequence's logits `[S, vocab]` in one call; a sequence
   that samples (temperature, penalties) or keeps to a grammar (its brain's `constraint`) draws
   with its own generator, as alone;
2. score: each press (positronic/presses/) scores the rows of its sequences from the last
   forward's attention shares `[S, capacity]` and its per-row state, all at once;
3. select: the shared selection picks each sequence's rows to delete (`[S, capacity]` bool;
   a press whose lanes keep their own rows, smartkv, picks them lane by lane, `[S, lanes, capacity]`);
4. apply: one edit for all (`SlotState.apply`): the gaps closed by one gather, one forward
   writing every new token, the mirrors committed.

Most rounds delete nothing (a press frees a batch of rows once it reaches its budget): such a
round is plain (`_plain_round`), steps 2-4 reduced to each press's scores and
`SlotState.advance` (no selection, no compaction; in a compiled engine three compiled calls:
batch/plain.py, the forward, state/plain.py). The same tokens, tensors and mirrors, bit for bit.

Lanes: an engine keeps `lanes` per sequence (1, layers, or layers x kv heads: SlotState); a
smartkv sequence needs its gates' (a lane per layer, or per kv head of a layer), and sequences
of shared-row presses run beside it with every lane alike. By default the engine takes the
lanes of the first sequence that joins it.

Sequences with the same press and settings score together: the loop is over kinds of press,
never over sequences. What does not run here yet (the single-sequence `Brain` and the
greenlet `Batch` do): recall with a press other than smartkv, SmartKV's pins, repairers, 4-bit formats, the ring store, pins
made after joining, refreshes. Input (typed turns, forced tokens) is given to a round
(`step(given)`) by the caller, which keeps the queue (the server's Conversation).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, fields
from typing import Hashable

import torch

from positronic.steps.sample import GREEDY_BELOW, greedy_many, greedy_tensor, sample, sample_many

from ..policies.scorers import Keyed
from ..policies.pressed import PressPolicy
from ..presses import PRESSES, Rows, make_press
from . import plain
from .plain import PRELUDES, recent_ids
from ..state.manager import default_capacity
from ..state.readonly import MirrorView
from ..state.slots import Inserts, SlotState


@dataclass
class Sequence:
    """An engine's record of one sequence: its press, settings and sampler."""

    key: Hashable
    press: object
    config: object
    generator: torch.Generator
    greedy: bool
    clock: int = 0  # rounds its press has scored
    carried: dict = field(default_factory=dict)  # the press's per-sequence state (random: its generator)
    culled: int = 0  # its ledger's culled tokens when it joined
    rebuilds: int = 0  # its rounds that failed (rebuilt from its mirror)
    constraint: object = None  # its brain's grammar (brain/grammar.py): it draws on its own, masked


@dataclass(frozen=True)
class _Kinds:
    """What plain rounds ask of an engine's sequences (`Engine._plain_kinds`), in slot order."""

    limits: list[int]  # the length each must stay below for a plain round (-1: its press plans every round)
    greedy: bool  # every one greedy and free of a grammar: the tokens stay on the device
    one_kind: bool  # one kind of press, penalty window and penalty, which compiles (`plain.fits`): one prelude


def press_for(config):
    """The press of `config.policy` with the settings `config` gives it (every field of the
    press's Settings that BrainConfig has, by name: a press's new setting needs no plumbing)."""
    if config.policy not in PRESSES:
        raise ValueError(f"policy {config.policy!r} has no press yet; Core v4 runs {', '.join(PRESSES)}")
    return make_press(config.policy, config)


def carried(press, brain) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """What `brain`'s policy carries, as `press` keeps it: per-row state of its live rows
    (`{name: [rows]}`, or `[lanes, rows]` for a press with lanes), per-sequence state, and the
    rounds it has scored."""
    policy, mirror = brain.policy, brain.state.mirror
    if isinstance(policy, PressPolicy):  # the press itself, ticking alone: its own state as it is
        return policy.carried(mirror.live.ledger_ids)
    own = press.carry(policy, mirror)  # a press that reads its policy's state itself (smartkv's memories)
    if own is not None:
        return own, press.sequence_state(), 0
    ids = mirror.live.ledger_ids
    rows, scorer = {}, getattr(policy, "scorer", None)
    for name, (dtype, fill) in press.row_state.items():
        if name == "brightness":
            values = [mirror.ledger[i].brightness for i in ids]
        else:  # a keyed scorer's number per ledger id (h2o's sums, scored's last access)
            values = [scorer.value.get(i, fill) for i in ids]
        rows[name] = torch.tensor(values, dtype=dtype)
    sequence = press.sequence_state()
    if "generator" in sequence:
        sequence["generator"] = scorer.generator.get_state()
    return rows, sequence, getattr(scorer, "clock", 0)


def restore(press, policy, live_ids: list[int], rows: dict[str, torch.Tensor], sequence: dict[str, torch.Tensor],
            clock: int) -> None:
    """`carried` backwards: `policy` (today's, of the press's name) takes the state the press
    kept for a sequence leaving the engine: a keyed scorer its numbers by ledger id
    (`live_ids`, the live rows' in row order; `rows`: {name: [rows]}) and the rounds scored,
    the random scorer its generator. Brightness goes to the mirror (`SlotState.copy_out`)."""
    if isinstance(policy, PressPolicy):
        policy.restored(live_ids, rows, sequence, clock)
        return
    scorer = getattr(policy, "scorer", None)
    for name, values in rows.items():
        if name != "brightness":
            scorer.current = Keyed(dict(zip(live_ids, values.tolist())), clock, [])
    if "generator" in sequence:
        scorer.generator.set_state(sequence["generator"])


GIVEN_SOURCES = ("user", "generated")  # ledger sources of given tokens: typed input, forced tokens

UNSUPPORTED = (("recall", False), ("repairer", "none"), ("kv_format", "float"), ("kv_store", "splice"),
               ("refresh_every", 0), ("refresh_kl", 0.0), ("reread", False))


def unsupported(brain) -> str | None:
    """Why `brain`'s settings or state cannot run on any engine (None: they can), before one
    is made. Every sequence that joins can leave into its Brain again (`Engine.hand_back`)."""
    config = brain.config
    if config.policy not in PRESSES:
        return f"policy {config.policy!r} has no press yet; Core v4 runs {', '.join(PRESSES)}"
    for name, usual in UNSUPPORTED:
        if name == "recall" and config.policy == "smartkv":
            continue  # the smartkv press runs recall (presses/recall.py)
        if getattr(config, name) != usual:
            return f"{name}={getattr(config, name)!r} does not run on Core v4 yet (only {usual!r})"
    if brain.state.per_layer and (getattr(brain.policy, "pinned_out", None)
                                  or any(brain.state.mirror.ledger[i].pinned for i in brain.state.mirror.live.ledger_ids)):
        return "smartkv with pinned rows does not run on Core v4 yet"
    return None


class Engine:
    """Up to `slots` sequences of at most `capacity` rows each (the largest budget among
    them), ticking in rounds; see the module docstring."""

    def __init__(self, lm, *, slots: int, capacity: int, score_layers="last", lanes: int | None = None,
                 compiled: bool = False):
        self.lm, self._lanes = lm, lanes  # lanes None: the first joining sequence's
        # compiled: every round's forward one graph (positronic/models/compiled.py)
        self._shape = dict(slots=slots, capacity=capacity, score_layers=score_layers, compiled=compiled)
        self.state = SlotState(lm, **self._shape, lanes=lanes or 1)
        self.sequences: list[Sequence] = []  # in slot order
        self.finished: dict[Hashable, object] = {}  # mirrors of sequences their press stopped
        self.seconds: dict[str, float] = {}
        self.removed: dict[Hashable, list[int]] = {}  # the last round's deleted rows (lane 0's) of each sequence
        self.removed_tokens: dict[Hashable, list[int]] = {}  # their token ids, in the same order
        self.deleted: torch.Tensor | None = None  # the last round's deleted rows, [active, lanes, capacity]
        self.lengths: dict[Hashable, int] = {}  # each sequence's live rows after the last round
        self.rounds = 0  # rounds run
        # plain rounds (`_plain_round`) where they apply; False: every round plans, selects and
        # compacts (what the tests compare them with)
        self.plain = True
        self.plain_made = 0  # of `rounds`, those that were plain
        self._kinds: _Kinds | None = None  # what plain rounds ask of the sequences; made again after a join or leave

    def __len__(self) -> int:
        return len(self.sequences)

    def keys(self) -> list[Hashable]:
        return [sequence.key for sequence in self.sequences]

    def warm(self, config=None) -> int:
        """A compiled engine with no sequence yet: make every bucket's graph now, rather than at
        the first round of each size (a server before it serves), and with `config` (the settings
        of the sequences to come) a plain round's writes for its press too, and greedy its
        prelude for the press and penalty. Returns the graphs made."""
        if len(self):
            raise ValueError(f"an engine is warmed before sequences join; {len(self)} have")
        press = None
        if config is not None and self.state.compiled is not None and config.policy in PRESSES:
            press = press_for(config)
        if press is None or not press.plain_rounds:
            return self.state.warm()
        state, before = self.state, PRELUDES.compiles
        names = {name: f"{press.name}.{name}" for name in press.row_state}
        for name, (dtype, fill) in press.row_state.items():  # as a joining sequence declares them
            state.declare(names[name], dtype, fill)
        state.declare("pinned", torch.bool, False)
        prelude = _greedy(config) and plain.fits(press)  # else a plain round's scores are the press's own, eager

        def scored(bucket: int) -> dict[str, torch.Tensor]:  # what a plain round's writes take, from the empty slots
            if not prelude:  # the state's own dtypes and layout, as the eager scores come padded
                return {full: state.row_state[full][:bucket].clone() for full in names.values()}
            _, values = self._run_prelude(press, config.penalty_window, config.repetition_penalty, [0] * bucket)
            return {names[name]: value for name, value in values.items()}
        return state.warm(scored) + PRELUDES.compiles - before

    def refusal(self, brain, *, returning: bool = False) -> str | None:
        """Why `brain` cannot join this engine (its settings or state, `unsupported`; the
        engine's room), or None: it can. `returning`: it joins now and is handed back after
        (the server's reply), so a full engine refuses it too."""
        if (reason := unsupported(brain)) is not None:
            return reason
        if brain.config.budget > self.state.capacity:
            return f"budget {brain.config.budget} does not fit the engine's {self.state.capacity} rows a sequence"
        if (rows := brain.state.rows_per_layer) > self.state.capacity:  # pins can hold a pruned prompt past its budget
            return f"its {rows} live rows do not fit the engine's {self.state.capacity} rows a sequence"
        if returning and len(self.sequences) == self.state.kv.slots:
            return f"all {self.state.kv.slots} slots are in use"
        return None

    def join(self, key: Hashable, brain, press=None, *, config=None) -> None:
        """Take a started `Brain` (prompt prefilled and pruned) in; it must not tick again
        unless it comes back (`hand_back`). `press`: the press its rounds run (default: its
        config's policy's, with its settings); `config`: its settings here, when they differ
        from the brain's own in sampling only (a request's temperature)."""
        if key in self.keys():
            raise ValueError(f"sequence {key!r} is already in the engine")
        if (reason := self.refusal(brain)) is not None:
            raise ValueError(reason)
        config = brain.config if config is None else config
        press = press if press is not None else press_for(config)
        press.bind(self.lm, brain.policy)
        self._take_lanes(press)
        mirror = brain.state.mirror
        for name, (dtype, fill) in press.row_state.items():
            self.state.declare(f"{press.name}.{name}", dtype, fill, lanes=press.lanes > 1)
        self.state.declare("pinned", torch.bool, False)
        for name, (shape, dtype, fill) in press.slot_state.items():
            self.state.declare_sequence(f"{press.name}.{name}", shape, dtype, fill)
        rows, sequence, clock = carried(press, brain)
        slots = {f"{press.name}.{name}": value for name, value in press.carry_slots(brain.policy, mirror).items()}
        row_state = {f"{press.name}.{name}": values for name, values in rows.items()}
        ids = mirror.live.ledger_ids if mirror.layers is None else mirror.layers.rows[0]  # lane 0's rows
        row_state["pinned"] = torch.tensor([mirror.ledger[i].pinned for i in ids], dtype=torch.bool)
        self.state.join(brain.state, tick=brain.tick, row_state=row_state, sequence_state=slots)
        generator = torch.Generator()
        generator.set_state(brain.generator.get_state())
        self._kinds = None
        self.sequences.append(Sequence(key, press, config, generator, greedy=_greedy(config), clock=clock,
                                       carried=sequence, culled=MirrorView(mirror).ledger.count("culled"),
                                       constraint=brain.constraint))

    def _take_lanes(self, press) -> None:
        """Make sure this engine keeps `press`'s lanes: an empty engine whose lanes were not
        given takes them (its state is made anew); otherwise ValueError."""
        state = self.state
        if press.lanes not in (1, state.lanes):
            if self.sequences or self._lanes is not None:
                raise ValueError(f"press {press.name} keeps rows in {press.lanes} lanes and this engine in "
                                 f"{state.lanes}: make the engine with lanes={press.lanes}")
            self.state = state = SlotState(self.lm, **self._shape, lanes=press.lanes)
        if (press.reads_lane_peaks or press.reads_query) and len(state.attention_layers) != self.lm.num_layers:
            raise ValueError(f"press {press.name} ranks by every layer's attention: make the engine with "
                             "score_layers='all'")

    def leave(self, key: Hashable):
        """Sequence `key` leaves; returns its mirror (the last sequence takes its slot)."""
        slot = self.keys().index(key)
        self._kinds = None
        last = self.sequences.pop()
        if slot < len(self.sequences):
            self.sequences[slot] = last
        return self.state.leave(slot)

    def hand_back(self, key: Hashable, brain) -> None:
        """Sequence `key` leaves into `brain`, the Brain it joined from: its state (rows copied
        out, `SlotState.copy_out`), tick, sampler and policy state as the rounds left them, so
        it ticks on alone exactly as if it had made those rounds itself (a press whose lanes
        keep their own rows restores its policy itself: `Press.restore`). ValueError if `key`
        is not in the engine."""
        slot = self.keys().index(key)
        sequence, state = self.sequences[slot], self.state
        press, rows = sequence.press, int(state.length[slot])
        kept = {name: state.row_state[f"{press.name}.{name}"][slot, ..., :rows].to("cpu", copy=True)
                for name in press.row_state}  # [rows], or [lanes, rows] with lanes apart
        # the slot's own tensors (recall's index: ~188 MB for SmolLM2), read by the press's restore
        # before the slot changes hands, not copied first (a copy cost 90 ms of a 230 ms hand-back)
        slots = {name: state.sequence_state[f"{press.name}.{name}"][slot].to("cpu")
                 for name in press.slot_state}
        brightness = kept["brightness"].tolist() if "brightness" in kept else None
        tick = state.tick(slot)
        manager = state.copy_out(slot, capacity=default_capacity(max(rows, brain.config.budget)), brightness=brightness)
        brain.state, brain.tick = manager, tick
        brain.generator.set_state(sequence.generator.get_state())
        if not press.restore(brain.policy, manager.mirror, kept, slots):
            restore(press, brain.policy, manager.mirror.live.ledger_ids, kept, sequence.carried, sequence.clock)
        self.leave(key)
        brain.counts["culls"] += manager.mirror.ledger.count("culled") - sequence.culled
        brain.counts["rebuilds"] += sequence.rebuilds

    @torch.no_grad()
    def step(self, given: dict[Hashable, tuple[int, str]] | None = None) -> dict[Hashable, int]:
        """One round: every active sequence makes one token; returns them by key. `given`:
        sequences that add a token they were given instead of drawing one, {key: (token id,
        ledger source)} ("user" for typed input, "generated" for a forced token, as
        `Brain.step` records them; their samplers do not move). A sequence whose press stops
        it (policy none at capacity) makes its last token in this round and leaves after it
        (its mirror goes to `finished`)."""
        clock = time.perf_counter()
        state, active = self.state, len(self.sequences)
        if not active:
            return {}
        given = given or {}
        if unknown := set(given) - set(self.keys()):
            raise ValueError(f"tokens given for sequences not in the engine: {sorted(map(repr, unknown))}")
        for key, (token, source) in given.items():
            if not (isinstance(token, int) and 0 <= token < self.lm.vocab_size) or source not in GIVEN_SOURCES:
                raise ValueError(f"sequence {key!r}: a given token is (id in 0..{self.lm.vocab_size - 1}, one of "
                                 f"{GIVEN_SOURCES}), got ({token!r}, {source!r})")
        if not given and self.plain and self._plain():
            return self._plain_round(clock)
        slots = {key: slot for slot, key in enumerate(self.keys())}
        tokens = self._sample(state.next_logits[:active], skip={slots[key] for key in given})
        sources = ["generated"] * active
        for key, (token, source) in given.items():
            tokens[slots[key]], sources[slots[key]] = token, source
        self.seconds = {"sample": (now := time.perf_counter()) - clock}
        device = state.length.device
        deleted = torch.zeros((active, state.lanes, state.capacity), dtype=torch.bool, device=device)
        stopped = torch.zeros(active, dtype=torch.bool, device=device)
        row_state, sequence_state, slot_state, writes, inserts = {}, {}, {}, {}, []
        for press, members in self._groups():
            index, names, whole, rows, inputs, clocks = self._group_inputs(press, members)
            plan = press.plan(rows, inputs, clocks)
            deleted[index] = plan.deleted if plan.deleted.dim() == 3 else plan.deleted[:, None]  # shared: every lane
            stopped[index] = plan.stop
            for name, full in names.items():
                self._merge(row_state, state.row_state, full, plan.next[name], index, whole)
            for name in press.sequence_state():
                for m, value in zip(members, plan.next[name]):
                    sequence_state[m, name] = value
            for name in press.slot_state:
                full = f"{press.name}.{name}"
                if name in plan.next:
                    self._merge(slot_state, state.sequence_state, full, plan.next[name], index, whole)
                if name in plan.writes:
                    local, items, values, axis = plan.writes[name]
                    if full in writes:  # another group of the same press name (other settings)
                        their_slots, their_items, their_values, _ = writes[full]
                        local, items, values = torch.cat([their_slots, index[local]]), \
                            torch.cat([their_items, items]), torch.cat([their_values, values])
                        writes[full] = (local, items, values, axis)
                    else:
                        writes[full] = (index[local], items, values, axis)
            if plan.inserts is not None:
                inserts.append((index, plan.inserts, names))
        planned = time.perf_counter()
        self.seconds["policy"] = planned - now
        leaving = deleted[:, 0]  # lane 0's deleted rows and their tokens, read before the gaps close
        leaving_tokens = state.token_ids[:active, 0][leaving]
        report = state.apply(deleted, tokens, row_state=row_state, inserts=self._inserts(inserts, active),
                             sequence_state=slot_state, sequence_writes=writes,
                             source=sources if given else "generated")
        self.seconds["apply"] = time.perf_counter() - planned
        self.seconds.update({f"apply.{k}": v for k, v in report.seconds.items()})
        self._begin_records(deleted)
        # one copy a round: the server's eviction counts, the run's edits in words
        for (slot, row), token in zip(leaving.nonzero().tolist(), leaving_tokens.tolist()):
            self.removed[self.sequences[slot].key].append(row)
            self.removed_tokens[self.sequences[slot].key].append(token)
        made = self._made(report, tokens, given, sequence_state)
        for slot in reversed(stopped.nonzero().flatten().tolist()):
            if slot not in report.failed:
                key = self.sequences[slot].key
                self.finished[key] = self.leave(key)
        return made

    def _plain(self) -> bool:
        """Whether this round can be plain: every sequence below its press's budget (so no press
        deletes a row) with a press whose rounds there are plain (`Press.plain_rounds`), its next
        logits finite and its next position and row within bounds, all known on the host."""
        known = self.state.known()
        return (known.finite and max(known.reach) < self.lm.max_positions
                and all(length < limit for length, limit in zip(known.lengths, self._plain_kinds().limits)))

    def _plain_kinds(self) -> "_Kinds":
        """What plain rounds ask of the sequences in, worked out once a membership."""
        if self._kinds is None:
            capacity, first = self.state.capacity, self.sequences[0]

            def kind(sequence) -> tuple:  # what one compiled prelude serves
                return sequence.press.group, sequence.config.penalty_window, sequence.config.repetition_penalty
            self._kinds = _Kinds(
                limits=[min(s.press.settings.budget, capacity) if s.press.plain_rounds else -1 for s in self.sequences],
                greedy=all(s.greedy and s.constraint is None for s in self.sequences),
                one_kind=plain.fits(first.press) and all(kind(s) == kind(first) for s in self.sequences))
        return self._kinds

    def _plain_round(self, clock: float) -> dict[Hashable, int]:
        """A round in which no sequence deletes a row (`_plain`): the tokens (greedy ones on the
        device; where any sequence samples or keeps to a grammar, `_sample`'s, as a full round
        draws them) and each press's next row state go to `SlotState.advance` with no selection,
        no compaction and, all greedy, one wait (the tokens coming back). The same tokens,
        tensors and mirrors as the full round (tested), in a few dozen operations instead of ~190."""
        state, active = self.state, len(self.sequences)
        greedy = self._plain_kinds().greedy
        fast = self._prelude() if greedy and state.compiled is not None else None  # one graph for tokens and scores
        if fast is not None:
            tokens = fast[0]
        elif greedy:
            tokens = self._greedy(state.next_logits[:active])
        else:
            tokens = torch.tensor(self._sample(state.next_logits[:active]), device=state.length.device)
        self.seconds = {"sample": (now := time.perf_counter()) - clock}
        row_state = fast[1] if fast is not None else self._scores()
        planned = time.perf_counter()
        self.seconds["policy"] = planned - now
        report = state.advance(tokens, row_state=row_state)
        self.seconds["apply"] = time.perf_counter() - planned
        self.seconds.update({f"apply.{k}": v for k, v in report.seconds.items()})
        self.plain_made += 1
        self._begin_records(report.deleted)
        return self._made(report, report.tokens, {}, {})

    def _scores(self) -> dict[str, torch.Tensor]:
        """A plain round's next per-row state by the state's names: each kind of press scores
        its sequences (`Press.score`), as its plan would."""
        row_state = {}
        for press, members in self._groups():
            index, names, whole, rows, inputs, clocks = self._group_inputs(press, members)
            _, scored = press.score(rows, inputs, clocks)
            for name, full in names.items():
                self._merge(row_state, self.state.row_state, full, scored[name], index, whole)
        return row_state

    def _group_inputs(self, press, members: list[int]):
        """What `press` reads for the sequences in slots `members`: their slots `index` [n], the
        press's row state names in the state, whether they are every active slot in order
        (`whole`), their `Rows`, their state by the press's names (per-row, per-slot, per-sequence)
        and the rounds each was scored (`clocks` [n])."""
        state, device = self.state, self.state.length.device
        index = torch.tensor(members, device=device)
        names = {name: f"{press.name}.{name}" for name in press.row_state}
        inputs = {name: state.row_state[full][index] for name, full in names.items()}
        # per-sequence tensors: the slots' own where the group is every slot in order (no copy);
        # a group of every slot in order (one kind of press in the round, the usual case) hands its
        # next states over as they are, a group of some slots writes its rows into a copy
        whole = members == list(range(len(self.sequences)))
        at = slice(0, len(members)) if whole else index
        inputs |= {name: state.sequence_state[f"{press.name}.{name}"][at] for name in press.slot_state}
        for name in press.sequence_state():
            inputs[name] = torch.stack([self.sequences[m].carried[name] for m in members])
        clocks = torch.tensor([self.sequences[m].clock for m in members], device=device)
        return index, names, whole, self._rows(press, index), inputs, clocks

    def _prelude(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """A compiled engine's plain round with one kind of press, penalty window and penalty
        (batch/plain.py): the tokens and the press's next row state by the state's names, for
        the round's whole bucket (`SlotState.advance` takes them so), from one compiled function;
        None where they differ."""
        first, state, active = self.sequences[0], self.state, len(self.sequences)
        press, window, penalty = first.press, first.config.penalty_window, first.config.repetition_penalty
        if not self._plain_kinds().one_kind:
            return None
        clocks = [s.clock for s in self.sequences] + [0] * (state.compiled.bucket(active) - active)
        tokens, scored = self._run_prelude(press, window, penalty, clocks)
        return tokens, {f"{press.name}.{name}": values for name, values in scored.items()}  # the whole bucket's

    def _run_prelude(self, press, window: int, penalty: float, clocks: list[int]):
        """The compiled prelude over the first len(`clocks`) slots (a bucket), `clocks` their rounds scored."""
        state, at = self.state, slice(0, len(clocks))
        return PRELUDES((press.group, window, penalty), functools.partial(plain.prelude, press, window, penalty),
                        state.next_logits[at], state.length[at], state.positions[at, 0],
                        state.token_ids[at, 0], state.shares[at], state.row_state["pinned"][at],
                        {name: state.row_state[f"{press.name}.{name}"][at] for name in press.row_state},
                        torch.tensor(clocks, device=state.length.device))

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """[active] int64 on the device: every sequence's greedy token (all greedy, logits known
        finite), as `_sample` draws them, unread."""
        groups = list(self._penalty_groups(range(len(self.sequences))))
        tokens = None if len(groups) == 1 else torch.zeros(len(self.sequences), dtype=torch.long, device=logits.device)
        for slots, index, recent in groups:
            drawn = greedy_tensor(logits[index], recent, [self.sequences[slot].config.repetition_penalty for slot in slots])
            if tokens is None:
                return drawn
            tokens[index] = drawn
        return tokens

    def _penalty_groups(self, slots):
        """The sequences in `slots` grouped by what their repetition penalty reads (the penalty
        window; lanes kept apart or not): each group's slots, their index [n] and their recent
        token ids [n, window] (`_recent`)."""
        groups: dict[tuple[int, bool], list[int]] = {}
        for slot in slots:
            sequence = self.sequences[slot]
            groups.setdefault((sequence.config.penalty_window, sequence.press.lanes > 1), []).append(slot)
        for (window, lanes), members in groups.items():
            index = torch.tensor(members, device=self.state.length.device)
            yield members, index, _recent(self.state, index, window, lanes)

    def _merge(self, merged: dict, kept: dict, full: str, values: torch.Tensor, index: torch.Tensor,
               whole: bool) -> None:
        """A press group's next state `values` [members, ...] into the round's `merged` (per-row
        or per-slot) under `full`: as it is for a group of every slot in order (one kind of press
        in the round, the usual case), else written at the group's slots `index` into a copy of
        the state `kept` holds (`SlotState.row_state` or `.sequence_state`)."""
        if whole and full not in merged:
            merged[full] = values
            return
        if full not in merged:
            merged[full] = kept[full][:len(self.sequences)].clone()
        merged[full][index] = values

    def _begin_records(self, deleted: torch.Tensor) -> None:
        """The round's records, before its deleted rows are listed: none yet for any sequence."""
        self.rounds += 1
        self.removed = {sequence.key: [] for sequence in self.sequences}
        self.removed_tokens = {sequence.key: [] for sequence in self.sequences}
        self.deleted = deleted  # [active, lanes, capacity]: every lane's, for whoever lists them (a run's log)

    def _made(self, report, tokens: list[int], given: dict, sequence_state: dict) -> dict[Hashable, int]:
        """After a round: each sequence's clock, grammar and carried state moved on, its token by
        key (none for a sequence whose round failed), and the live lengths (known to the state,
        read in one copy where they are not)."""
        made = {}
        for slot, sequence in enumerate(self.sequences):
            if slot in report.failed:
                sequence.rebuilds += 1
                continue
            sequence.clock += 1
            if sequence.constraint is not None and sequence.key not in given:  # a drawn token moves its grammar
                sequence.constraint.advance(tokens[slot])
            sequence.carried.update({name: value.clone() for (m, name), value in sequence_state.items() if m == slot})
            made[sequence.key] = tokens[slot]
        self.lengths = dict(zip(self.keys(), self.state.known().lengths))
        return made

    def _inserts(self, given: list, active: int) -> Inserts | None:
        """The round's rows coming back for every active sequence, from each press group's
        (`[members, ...]`, row state by the press's names) padded to the widest."""
        if not given:
            return None
        state, device = self.state, self.state.length.device
        width = max(part.taken.shape[2] for _, part, _ in given)
        layers, kv_heads, head_dim = self.lm.num_layers, self.lm.num_kv_heads, self.lm.head_dim
        taken = torch.zeros((active, state.lanes, width), dtype=torch.bool, device=device)
        positions = torch.zeros((active, width), dtype=torch.long, device=device)
        token_ids = torch.zeros_like(positions)
        keys = torch.zeros((active, width, layers, kv_heads, head_dim), dtype=state.kv.keys.dtype, device=device)
        values = torch.zeros_like(keys)
        row_state = {}
        for index, part, names in given:
            j = part.taken.shape[2]
            taken[index, :, :j], positions[index, :j], token_ids[index, :j] = part.taken, part.positions, part.token_ids
            keys[index, :j], values[index, :j] = part.keys, part.values
            for name, value in part.row_state.items():
                full = names[name]
                if full not in row_state:
                    fill = state.row_fill[full]
                    row_state[full] = torch.full((active, state.lanes, width), fill, dtype=value.dtype, device=device)
                row_state[full][index, :, :j] = value
        return Inserts(taken, positions, token_ids, keys, values, row_state)

    def _rows(self, press, index: torch.Tensor) -> Rows:
        """What `press` reads of the sequences in slots `index` [S]: lane 0's rows (every
        lane's when they differ), and a reader of their K/V if it reads keys."""
        state, lanes = self.state, press.lanes > 1

        def read(members: torch.Tensor, rows: torch.Tensor):
            return state.read(index[members], rows)
        return Rows(length=state.length[index], positions=state.positions[index, 0], shares=state.shares[index],
                    pinned=state.row_state["pinned"][index], lane_positions=state.positions[index] if lanes else None,
                    lane_peaks=state.lane_peaks[index] if press.reads_lane_peaks else None,
                    read=read if press.reads_keys else None,
                    query=state.queries[index] if press.reads_query else None,
                    log_norm=state.log_norms[index] if press.reads_query else None,
                    token_ids=state.token_ids[index, 0] if press.reads_query else None)

    def _groups(self):
        """(press, slots) for each kind of press among the active sequences (`Press.group`)."""
        groups: dict[tuple, tuple[object, list[int]]] = {}
        for slot, sequence in enumerate(self.sequences):
            groups.setdefault(sequence.press.group, (sequence.press, []))[1].append(slot)
        return groups.values()

    def _sample(self, logits: torch.Tensor, skip: set[int] = frozenset()) -> list[int]:
        """Step 1 for every sequence: the greedy ones in one batched argmax per penalty window
        (their repetition penalties applied as `steps.sample` would), each other one its own
        draw. Rows whose logits are not finite are rebuilt from their mirrors first, as a
        Brain does; if they stay so, NonFiniteLogits. Slots in `skip` draw nothing (their
        token is given; their entry is 0)."""
        state = self.state
        finite = torch.isfinite(logits.amax(dim=-1))  # a row of NaN, inf or nothing finite is not
        bad = [] if bool(finite.all()) else (~finite).nonzero().flatten().tolist()  # one wait when all are
        if bad:
            state.rebuild(bad)
            logits = state.next_logits[: len(self.sequences)]
        tokens: list[int] = [0] * len(self.sequences)
        free = [slot for slot, sequence in enumerate(self.sequences) if slot not in skip and sequence.constraint is None]
        for slots, index, recent in self._penalty_groups([slot for slot in free if self.sequences[slot].greedy]):
            penalties = [self.sequences[slot].config.repetition_penalty for slot in slots]
            for slot, token in zip(slots, greedy_many(logits[index], recent, penalties, finite=not bad)):
                tokens[slot] = token
        # the common samplers at once (steps.sample_many)
        drawn = [slot for slot in free if not self.sequences[slot].greedy and _batched_draw(self.sequences[slot].config)]
        for slots, index, recent in self._penalty_groups(drawn):
            configs = [self.sequences[slot].config for slot in slots]
            settings = [(c.temperature, c.top_k, c.top_p, c.min_p, c.repetition_penalty) for c in configs]
            made = sample_many(logits[index], recent, settings, [self.sequences[slot].generator for slot in slots])
            for slot, token in zip(slots, made):
                tokens[slot] = token
        drawn = set(drawn)
        for slot, sequence in enumerate(self.sequences):
            if (not sequence.greedy or sequence.constraint is not None) and slot not in drawn and slot not in skip:
                cfg = sequence.config
                length = int(state.length[slot])
                if sequence.press.lanes > 1:
                    ids, newest = union_recent(state, torch.tensor([slot], device=logits.device), cfg.penalty_window)
                    recent = ids[0][newest[0]].flip(0).tolist()  # oldest first, as the live map's tail
                else:
                    recent = state.token_ids[slot, 0, max(0, length - cfg.penalty_window) : length].tolist()
                tokens[slot] = sample(
                    logits[slot], temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
                    repetition_penalty=cfg.repetition_penalty, presence_penalty=cfg.presence_penalty,
                    frequency_penalty=cfg.frequency_penalty, logit_bias=cfg.sampling.bias, recent_ids=recent,
                    generator=sequence.generator,
                    allowed=None if sequence.constraint is None else sequence.constraint.allowed()).token_id
        return tokens


def union_recent(state: SlotState, index: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last `window` tokens of the sequences in slots `index` [S] as their mirrors' live maps
    end (the union of every lane's rows: what a Brain's penalties look at), newest first: token
    ids [S, K] and which of them are those tokens [S, K] bool (the rest repeat some of them).
    A token among the union's last `window` is among the last `window` rows of every lane that
    holds it, so only those rows are read; where every lane holds the same ones, lane 0's are it."""
    take = min(window, state.capacity)
    rows = (state.length[index, None] - take + torch.arange(take, device=index.device)).clamp(min=0)  # [S, take]
    rows = rows[:, None].expand(-1, state.lanes, -1)  # short sequences repeat their row 0
    ids, positions = state.token_ids[index].gather(2, rows), state.positions[index].gather(2, rows)  # [S, L, take]
    if bool((positions == positions[:, :1]).all()):
        ids, positions = ids[:, 0].flip(1), positions[:, 0].flip(1)
    else:  # the newest distinct positions of all lanes
        order = positions.flatten(1).argsort(dim=1, descending=True)
        ids, positions = ids.flatten(1).gather(1, order), positions.flatten(1).gather(1, order)
    first = torch.ones_like(positions, dtype=torch.bool)
    first[:, 1:] = positions[:, 1:] != positions[:, :-1]
    return ids, first & (first.cumsum(dim=1) <= window)


def _recent(state: SlotState, index: torch.Tensor, window: int, lanes: bool) -> torch.Tensor:
    """[S, window] token ids whose repetition penalty the sequences in slots `index` [S] take:
    their last `window` tokens (a sequence with fewer repeats its row 0; with `lanes`, the
    union of its lanes' rows, `union_recent`, a repeated id standing for the rest: an id is
    penalised once however often it is listed)."""
    if lanes:
        recent, newest = union_recent(state, index, window)
        return torch.where(newest, recent, recent[:, :1])
    return recent_ids(state.token_ids[index, 0], state.length[index], window)


def _batched_draw(config) -> bool:
    """Whether `config` samples with only what `steps.sample_many` draws for many at once
    (no bias, no presence or frequency penalty)."""
    return not (config.presence_penalty or config.frequency_penalty or config.sampling.bias)


def _greedy(config) -> bool:
    """Whether `config` picks by argmax after at most a repetition penalty (`greedy_many`)."""
    return (config.temperature <= GREEDY_BELOW and not config.presence_penalty and not config.frequency_penalty
            and not config.sampling.bias)
