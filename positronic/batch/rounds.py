"""Several sequences' ticks in the calling thread, round by round: each sequence's work is a
greenlet that pauses at every model forward it makes.

`Batch.step` runs here. Each brain ticks exactly as it would alone (its policy, its edits, its
mirror) until it asks for a model forward (`state.forward.forward`, through `MEETING`); its
greenlet then pauses with the prepared part. Once every sequence is paused or done, the
paused parts go through one `forward_many` (`rendezvous.shared_forward`: a failed shared
forward is run again one sequence at a time, so only the sequence at fault fails), and each
greenlet resumes with its own result. A prompt's chunks are forwards like a tick's, so a
sequence that starts its prompt pauses once per chunk while the others tick.

Why not a thread per sequence, as the server's jobs (`Rendezvous`). Every torch call lets
the GIL go, so B threads hand it over at every small op of every tick, and each sequence's
host work cost 2-3x its time alone (random:tiny on the CPU: 1.6 ms a tick alone, 3.1 at B = 8,
4.4 at B = 32). In one thread a switch is a greenlet's, at the forward only.
bench/results/batch.md, 2026-11-30, the same brains and tokens: random:tiny's rounds about
2x faster at B = 8 and 32; SmolLM2's at B = 8 the same within this host's noise (its forward,
not the ticks, is most of a round there). Where the host bounds a round, as on a GPU, that is
what batching gains.

The ticks' own ops run with one torch thread, the forwards (shared, or alone: probes, the
ring store) with the caller's count, as the server's job threads and runner do
(threads.py). With the caller's two threads for the ticks' ops too, SmolLM2's default policy
ran its rounds at B = 8 20% slower: its ticks' mid-sized ops (recall's scan of its index)
then waited on OpenMP's second thread.

The server keeps its threads: its jobs wait on a session's lock and write checkpoints while
the others tick (`Rendezvous.aside`), which a greenlet of the forward thread could not do
without holding every sequence up.

torch's grad mode is the thread's, and greenlets share the thread: each greenlet starts in
the caller's mode and gets its own back after every pause, and the caller's is restored after
every switch back here. (Nothing in a tick pauses inside `torch.inference_mode`, whose guards
could not be swapped this way.)
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Hashable

import torch
from greenlet import getcurrent, greenlet

from ..state.batched import SHARED_PREFILL_CHUNK, shareable
from ..state.forward import MEETING, ForwardResult, forward_alone, prepare
from .rendezvous import Failed, shared_forward


class _Pause:
    """A sequence's greenlet waiting for its part's forward."""

    __slots__ = ("lm", "part")

    def __init__(self, lm, part):
        self.lm, self.part = lm, part


class _Done:
    """A work's end: what it returned, or the Exception it raised."""

    __slots__ = ("outcome",)

    def __init__(self, outcome):
        self.outcome = outcome


def _by_model(paused: dict) -> list[list]:
    """The paused works' names, grouped by the model their forward runs (in pausing order)."""
    groups: dict[int, list] = {}
    for name, pause in paused.items():
        groups.setdefault(id(pause.lm), []).append(name)
    return list(groups.values())


class Rounds:
    """Runs several works (a brain's tick each) in the calling thread, their forwards shared
    round by round (see the module docstring): one forward per model a round, when the works
    run more than one. `MEETING` is set to it inside each work."""

    def __init__(self, *, prefill_chunk: int = SHARED_PREFILL_CHUNK):
        self.prefill_chunk = prefill_chunk  # a prompt's tokens a forward carries beside the others' ticks
        self.forwards = 0  # shared forwards run
        self.fed = 0  # sequences they fed
        self.retries = 0  # shared forwards that failed and were run again one sequence at a time
        self._driver: greenlet | None = None  # the greenlet in `run`
        self._cores = 1  # the caller's torch threads, which the forwards run with (the ticks with one)

    def run(self, works: dict[Hashable, Callable[[], object]]) -> dict[Hashable, object]:
        """Each `work()` to its end; returns what each returned, or the Exception it raised (the
        others go on unaffected). RuntimeError if called from inside a work."""
        if self._driver is not None:
            raise RuntimeError("Rounds.run is already running: a sequence's work cannot start a round of its own")
        self._driver = getcurrent()
        grad = torch.is_grad_enabled()
        cores = self._cores = torch.get_num_threads()
        outcomes: dict[Hashable, object] = {}
        paused: dict[Hashable, _Pause] = {}
        try:
            lets = {name: self._greenlet(work) for name, work in works.items()}
            torch.set_num_threads(1)
            for name, let in lets.items():
                self._went(name, let.switch(), paused, outcomes, grad)
            while paused:
                results = {}
                torch.set_num_threads(cores)
                for names in _by_model(paused):  # one forward feeds one model
                    shared, retried = shared_forward(paused[names[0]].lm, [paused[name].part for name in names])
                    results.update(zip(names, shared))
                    self.forwards += 1
                    self.fed += len(names)
                    self.retries += retried
                torch.set_num_threads(1)
                paused = {}
                for name, result in results.items():
                    self._went(name, lets[name].switch(result), paused, outcomes, grad)
        finally:
            self._driver = None
            torch.set_grad_enabled(grad)
            torch.set_num_threads(cores)
        return {name: outcomes[name] for name in works}

    def _greenlet(self, work: Callable[[], object]) -> greenlet:
        def body() -> _Done:
            MEETING.set(self)
            try:
                return _Done(work())
            except Exception as error:  # this sequence's failure: the others go on
                return _Done(error)

        let = greenlet(body)
        let.gr_context = contextvars.copy_context()  # what the caller had set, as a plain call sees it
        return let

    @staticmethod
    def _went(name, where, paused: dict, outcomes: dict, grad: bool) -> None:
        """A greenlet switched back: paused at a forward, or done. The caller's grad mode again
        (the next greenlet to start starts in it)."""
        torch.set_grad_enabled(grad)
        if isinstance(where, _Pause):
            paused[name] = where
        else:
            outcomes[name] = where.outcome

    def forward(self, lm, cache, token_ids: list[int], positions: list[int], key_positions: list[int], *,
                attention_layers: list[int] | None = None, probes=None, weights: bool = True) -> ForwardResult:
        """`state.forward.forward`'s contract, from inside a work: pauses until the round's
        shared forward has run. A forward that cannot be shared (probes, the ring store) runs
        at once, on its own."""
        if self._driver is None or getcurrent() is self._driver:
            raise RuntimeError("a forward through Rounds must come from a work that Rounds.run is running")
        if not shareable(cache, probes):
            torch.set_num_threads(self._cores)
            try:
                return forward_alone(lm, cache, token_ids, positions, key_positions, attention_layers=attention_layers,
                                     probes=probes, weights=weights)
            finally:
                torch.set_num_threads(1)
        part = prepare(lm, cache, token_ids, positions, key_positions, attention_layers=attention_layers,
                       weights=weights)
        grad = torch.is_grad_enabled()
        result = self._driver.switch(_Pause(lm, part))
        torch.set_grad_enabled(grad)
        if isinstance(result, Failed):
            raise result.error
        return result
