"""The tick loop: Steps 1–3 decide, Step 4 (StateManager.apply) acts.

One tick: sample the next token from the last forward's logits (1), or take the token the
caller forces (teacher forcing: `eval` runs through this same loop); score every live row by
the newest token's attention (2a); the policy updates brightness (2b), picks what to cut when
the context is at or over budget (3a–3b) and asks its repairer for replacements (3c–3d);
everything becomes one action list with the add last (3e); `apply` (4) runs the one forward
that leaves the next tick's logits and attention row. The policy sees a read-only view; the
tick number and its brightness reach the StateManager as arguments of `apply`. The policy's
plan carries its next state; it becomes current only when `apply` went through (the tick
commits), so a failed or interrupted tick leaves the policy as it was.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import torch

from positronic import steps

from . import chat
from .config import BrainConfig, check_budget  # noqa: F401  (BrainConfig is imported from here too)
from .grammar import Constraint  # noqa: F401  (a type; llguidance is imported only when a grammar is made)
from ..state.actions import loggable
from ..policies import POLICIES, make_policy
from ..state.manager import StateManager, default_capacity
from ..text import rows_matching, span_texts


def cache_capacity(context_length: int, budget: int, kv_store: str = "splice") -> int:
    """Rows to preallocate for a run: room for the larger of context and budget. A ring gets
    exactly that: the live length never exceeds it, and every slot beyond the live rows is
    one the model's attention reads and masks (the splice store wants spare rows instead, so
    that it packs its rows down less often)."""
    rows = max(context_length, budget)
    return rows if kv_store == "ring" else default_capacity(rows)


def pinned_rows(lm, prompt_ids: list[int], pins, config: BrainConfig) -> list[int]:
    """Prompt rows covered by an occurrence of one of the `pins` texts (see Brain.start)."""
    texts = span_texts(lm.decode, prompt_ids)
    rows: set[int] = set()
    for needle in pins:
        found = rows_matching(texts, needle)
        if not found:
            raise ValueError(f"--pin {needle!r} does not occur in the prompt")
        rows.update(found)
    policy = POLICIES[config.policy]
    if rows and policy.name != "none":
        room = config.budget - max(config.sinks, config.protect) - policy.window(config, config.budget) - policy.batch(config)
        if len(rows) > room:
            raise ValueError(f"{len(rows)} pinned rows leave the {config.policy} policy no room to evict at budget "
                             f"{config.budget} (at most {max(room, 0)})")
    return sorted(rows)


@dataclass
class TickRecord:
    """What one tick did, for the event log, the progress line and the terminal view."""

    tick: int
    token_id: int
    text: str
    actions: list[dict]
    outcomes: list[tuple[tuple[int, ...], str]]
    live_length: int  # rows each layer holds after the tick: what the budget bounds
    brightness_min: float
    brightness_mean: float
    brightness_max: float
    rebuilt: bool = False
    error: str | None = None
    stopped: bool = False  # the policy could not go on; the run ends after this tick
    source: str = "generated"  # the added token's ledger source: "user" when it was typed input
    seconds: dict[str, float] = field(default_factory=dict)  # per step
    removed: list[dict] = field(default_factory=list)  # {"ledger_id", "text"} of each row the edits took out
    live_tokens: int | None = None  # tokens some layer holds (the live map); > live_length only when layers differ
    complete: bool = False  # the brain's grammar (brain/grammar.py) is whole after this token: nothing may follow

    def __post_init__(self):
        if self.live_tokens is None:
            self.live_tokens = self.live_length

    def to_json(self) -> dict:
        record = {f.name: getattr(self, f.name) for f in fields(self)}  # asdict would deep-copy a restore's K/V
        return {"record": "tick", **record, "actions": [loggable(action) for action in self.actions]}


class Observer(Protocol):
    """Sees every action list just before and just after Step 4 (fixture capture uses it),
    and the Step 2b brightness that goes with it (None: unchanged). An observer whose class
    says `sees_rounds = True` also takes a brain's ticks made as engine rounds
    (positronic/batch), which apply no action list: `round(brain, record)` after each; a brain
    with any other observer takes no seat in an engine."""

    def before_apply(self, brain: "Brain", actions: list[dict], brightness=None) -> None: ...

    def after_apply(self, brain: "Brain", actions: list[dict], report) -> None: ...


class Brain:
    """A StateManager plus the policy that drives it, tick after tick."""

    def __init__(self, state: StateManager, config: BrainConfig, *, tick: int = 0,
                 generator_state: torch.Tensor | None = None, pending_input: Sequence[int] = (),
                 run_id: str | None = None):
        check_budget(state.lm, config)
        if state.kv_format != config.kv_format:
            raise ValueError(f"the state stores its cache as {state.kv_format}, the settings say {config.kv_format}")
        if state.kv_store != config.kv_store:
            raise ValueError(f"the state keeps its cache in the {state.kv_store} store, the settings say {config.kv_store}")
        self.state, self.config, self.tick = state, config, tick
        # names this run in its session and event log: an events file is appended to only by its run
        self.run_id = run_id or uuid.uuid4().hex
        self.policy = make_policy(config.policy, state.lm, config)
        if self.policy.per_layer:
            state.split_layers(self.policy.heads)  # a no-op for a resumed state that has them
        self.observers: list[Observer] = []
        self.generator = torch.Generator().manual_seed(config.seed)
        if generator_state is not None:
            self.generator.set_state(generator_state)
        self.counts = {"repairs": 0, "culls": 0, "rebuilds": 0, "refreshes": 0}
        self.last_divergence: float | None = None
        self._pending: deque[int] = deque(pending_input)  # user-turn tokens still to add
        # a grammar every drawn token keeps to (brain/grammar.py; the caller sets and clears it:
        # a reply's, never saved with a session); given tokens neither read nor move it
        self.constraint: Constraint | None = None

    @property
    def pending_input(self) -> tuple[int, ...]:
        """The token ids of typed input not added yet, in order (saved with a session)."""
        return tuple(self._pending)

    def input_added(self) -> int:
        """The first queued typed token went in by another way than `step` (a round of Core
        v4's engine, which the caller gave it to): it leaves the queue; returns it."""
        if not self._pending:
            raise ValueError("no typed input is queued")
        return self._pending.popleft()

    def say(self, text: str) -> list[int]:
        """Queue `text` as a user turn (positronic/brain/chat.py): the following ticks that force
        nothing add its tokens one per tick instead of sampling (ledger source "user"), then
        generation goes on. Returns the queued ids ([] for a blank line); TurnRefused for a line
        too long for the budget."""
        ids = chat.user_turn(self.state.lm, text, limit=chat.turn_limit(self.config))
        self._pending.extend(ids)
        return ids

    @classmethod
    def start(cls, lm, prompt_ids: list[int], config: BrainConfig | None = None, *, pins=()) -> "Brain":
        """Prefill the prompt and return the brain, ready for its first tick. `pins`: texts
        whose every occurrence in the prompt is pinned (never evicted or repaired); ValueError
        if one does not occur, or if the pins leave the policy no room under the budget.

        A prompt longer than the budget is brought within it before the first tick (a bulk
        prune, as SmartKV does after prefill): every prompt token but the last is prefilled,
        the policy prunes that context down to `budget - 1` rows from the attention of its
        newest row, and the last prompt token is added in the same edit, so its logits
        start the run from the pruned context; a policy that looks right after a forward
        (SmartKV's recall with `reread`) then looks with that token's query. The tick count
        stays 0.
        """
        config = config or BrainConfig()
        check_budget(lm, config)
        if config.policy == "none" and config.at_capacity == "stop" and len(prompt_ids) >= config.budget:
            raise ValueError(f"the prompt is {len(prompt_ids)} tokens and fills the budget of {config.budget}: policy "
                             "none with at_capacity stop evicts nothing, so no token could be generated (raise "
                             "--budget, or use --at-capacity shift or another policy)")
        if len(prompt_ids) > lm.max_positions:  # before any work: a 10 MB prompt fails at once
            raise ValueError(f"the prompt is {len(prompt_ids)} tokens, more than {lm.name}'s {lm.max_positions} "
                             "positions (a prompt must fit them; it is then pruned to the budget)")
        pinned = pinned_rows(lm, prompt_ids, pins, config)
        start = steps.RULES[config.brightness].start
        long = len(prompt_ids) > config.budget
        state = StateManager.from_tokens(lm, prompt_ids[:-1] if long else prompt_ids, brightness=start,
                                         capacity=cache_capacity(len(prompt_ids), config.budget, config.kv_store),
                                         score_layers=config.recorded_layers, kv_format=config.kv_format,
                                         kv_store=config.kv_store, sinks=max(config.sinks, config.protect))
        brain = cls(state, config)
        state.pin([row for row in pinned if row < len(state)])
        if long:
            view = state.view(keys=config.recall or brain.policy.reads_keys)
            plan = brain.policy.prune(view, steps.scores(state.last_attention, config.scored_layers), config.budget - 1)
            edit = steps.consolidate(prompt_ids[-1], plan.actions, state.bounds)
            report = state.apply(edit, tick=0, brightness=plan.brightness, add_source="prompt")
            if report.rebuilt:
                raise RuntimeError(f"pruning the prompt to the budget failed: {report.error}")
            brain.policy.commit(plan.next)  # e.g. the pruned prompt rows become recallable
            if len(prompt_ids) - 1 in pinned:
                state.pin([len(state) - 1])
            brain._reread(typed=False)  # the last prompt token's look, as after every forward of a tick
        return brain

    def step(self, force: int | None = None) -> TickRecord:
        """Run one tick. `force`: add this token instead of sampling one (teacher forcing);
        without it, a queued user-turn token is added if there is one (`say`), else one is
        sampled. Only sampling advances the sampler."""
        cfg, sm, seconds = self.config, self.state, {}
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            seconds[name] = now - clock
            clock = now

        self.tick += 1
        sampler = self.generator.get_state()
        try:
            view = sm.view(keys=cfg.recall or self.policy.reads_keys)
            # Step 1
            source = "user" if force is None and self._pending else "generated"
            if source == "user":
                token_id = self._pending[0]
            elif force is None:
                recent = view.token_ids[-cfg.penalty_window:].tolist() if cfg.penalty_window else ()

                def draw() -> int:
                    return steps.sample(sm.next_logits, temperature=cfg.temperature, top_k=cfg.top_k,
                                        top_p=cfg.top_p, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty,
                                        presence_penalty=cfg.presence_penalty,
                                        frequency_penalty=cfg.frequency_penalty, logit_bias=cfg.sampling.bias,
                                        recent_ids=recent, generator=self.generator,
                                        allowed=None if self.constraint is None else self.constraint.allowed()).token_id
                try:
                    token_id = draw()
                except steps.NonFiniteLogits:  # the cache held garbage: recompute it from the mirror, draw again
                    sm.rebuild()
                    self.counts["rebuilds"] += 1
                    view = sm.view(keys=cfg.recall or self.policy.reads_keys)
                    token_id = draw()
            else:
                token_id = force
            lap("sample")
            # Step 2a (the attention row holds only the scored layers), then the policy (Steps 2b-3d)
            # a per-layer policy scores rows itself (the attention row covers layer rows, not live rows)
            scores = [] if sm.per_layer else steps.scores(sm.last_attention, cfg.scored_layers)
            lap("attention")
            plan = self.policy.plan(view, scores, seconds, typed=source == "user")
            clock = time.perf_counter()
            # Step 3e and Step 4
            edit = steps.consolidate(token_id, plan.actions, sm.bounds)
            actions = list(edit.actions)  # the wire format, for observers and the tick's record
            for observer in self.observers:
                observer.before_apply(self, actions, brightness=plan.brightness)
            report = sm.apply(edit, tick=self.tick, brightness=plan.brightness, probes=plan.probes,
                              add_source=source)
        except BaseException:
            # Ctrl-C (or a failure) before the tick was applied: it did not happen, so the tick
            # count and the sampler go back to where they were (the policy's next state was
            # never committed) and a saved session resumes exactly
            self.tick -= 1
            self.generator.set_state(sampler)
            raise
        if not report.rebuilt:  # the tick commits: the policy's next state becomes current
            self.policy.commit(plan.next, report.probe_logprobs)
            if self.constraint is not None and source == "generated" and force is None:
                self.constraint.advance(token_id)
            if source == "user":
                self._pending.popleft()
        for observer in self.observers:
            observer.after_apply(self, actions, report)
        lap("apply")
        outcomes = plan.outcomes
        if not report.rebuilt and (after := self._reread(typed=source == "user")) is not None:
            actions, outcomes = actions + after[0], outcomes + after[1]
            lap("reread")
        if not report.rebuilt and self._refresh_due(report):
            sm.rebuild()
            self.counts["refreshes"] += 1
            lap("refresh")
        # the tokens the edits took out of the context: live before, not after (a deleted row, a
        # replaced pair, a token every layer dropped); a failed tick took nothing out
        entries = sm.mirror.ledger.entries
        still = set(sm.mirror.live.ledger_ids)
        removed = [] if report.rebuilt else [{"ledger_id": i, "text": entries[i].text}
                                             for i in view.ledger_ids.tolist() if i not in still]
        if not report.rebuilt:
            self.counts["repairs"] += sum(a["action"] == "replace_pair" for a in actions)
            self.counts["culls"] += sum(entries[r["ledger_id"]].state == "culled" for r in removed)
        self.counts["rebuilds"] += report.rebuilt
        live = sm.mirror
        new_brightness = live.brightness()
        # a failed tick added nothing: no text to show for it
        text = "" if report.rebuilt else live.ledger[live.live.ledger_ids[-1]].text
        return TickRecord(
            tick=self.tick, token_id=token_id, text=text,
            actions=actions, outcomes=outcomes, live_length=sm.rows_per_layer, live_tokens=len(live),
            brightness_min=min(new_brightness), brightness_mean=sum(new_brightness) / len(new_brightness),
            brightness_max=max(new_brightness), rebuilt=report.rebuilt, error=report.error, stopped=plan.stop,
            source=source, seconds=seconds, removed=removed,
            complete=self.constraint is not None and self.constraint.done)

    def _reread(self, *, typed: bool) -> tuple[list[dict], list] | None:
        """After the tick's forward, a policy that looks right away (SmartKV's recall with
        `reread`) plans from the query it made; what it brings back goes in with a reread of
        the newest row, so the next token is drawn (or scored) from logits that saw it. Part of
        this tick: its actions and outcomes join the tick's record. A failed reread leaves the
        state rebuilt from the mirror, the token added, the look's state not committed."""
        if not getattr(self.policy, "reread", False):  # no view made on a tick that has nothing to look for
            return None
        plan = self.policy.after_forward(self.state.view(keys=True), typed=typed)
        if plan is None:
            return None
        if not plan.actions:  # the look found nothing: its clock stands
            self.policy.commit(plan.next)
            return None
        actions = [*plan.actions, {"action": "reread"}]
        for observer in self.observers:
            observer.before_apply(self, actions)
        report = self.state.apply(actions, tick=self.tick)
        if not report.rebuilt:
            self.policy.commit(plan.next)
        self.counts["rebuilds"] += report.rebuilt
        for observer in self.observers:
            observer.after_apply(self, actions, report)
        return actions, plan.outcomes

    KL_CHECK_EVERY = 50  # ticks between divergence measurements for refresh_kl

    def _refresh_due(self, report) -> bool:
        """Periodic refresh, or a threshold on the measured divergence (DESIGN §4 fidelity)."""
        cfg = self.config
        if cfg.refresh_every and self.tick % cfg.refresh_every == 0:
            return True
        if cfg.refresh_kl and self.tick % self.KL_CHECK_EVERY == 0 and self.state.next_logits is not None:
            self.last_divergence = self.state.divergence()
            return self.last_divergence > cfg.refresh_kl
        return False

    def generator_state(self) -> torch.Tensor:
        return self.generator.get_state()
