"""Where the ticks of several sequences meet for one forward.

Each sequence ticks in a thread of its own, exactly as it would alone: its policy, its edits,
its mirror. A thread whose `MEETING` is a Rendezvous hands every model forward it makes (a
tick's, a prefill's chunks) to it and waits. Once every sequence at work is either waiting
here or done, the waiting forwards run as one (`forward_many`), in the thread of one of
them; each sequence then goes on with its own result. Python work is serialised by the GIL
as it would be anyway; the forward, which reads every weight once for all of them, is shared.

A shared forward that fails is run again one sequence at a time (appended rows taken back
first; rows written into a splice's gaps are simply written again), so only the sequence at
fault sees the error, and rebuilds itself as it would alone. A forward that cannot be shared
(probes, the ring store) runs alone, at once.

`linger` (seconds): how long a round waits, once nobody is at work, for the sequences of the
previous round that have not come back yet (a server's requests come back for their next token through its event loop;
without it each round would go with whoever happened to be first). A round never waits for
anyone while a sequence is still at work: it cannot run before they are all waiting anyway.

    meeting = Rendezvous()
    meeting.expect(2)                       # before the sequences' threads start
    # in each thread:  MEETING.set(meeting); brain.step(); meeting.done()
"""

from __future__ import annotations

import threading
import time

from ..state.forward import ForwardResult, Prepared, forward_alone, prepare
from ..state.batched import forward_many

class _Ticket:
    """One sequence's forward, waiting for its turn; then its result (or the error it raised)."""

    def __init__(self, lm, part: Prepared):
        self.lm, self.part, self.done = lm, part, False
        self.result: ForwardResult | BaseException | None = None


class Rendezvous:
    """Counts the sequences at work (not waiting here, not done) and runs the waiting forwards
    together when none is (see the module docstring)."""

    def __init__(self, *, linger: float = 0.0, prefill_chunk: int = 64, on_forward=lambda sequences: None):
        self.linger, self.prefill_chunk, self.on_forward = linger, prefill_chunk, on_forward
        self._turn = threading.Condition()
        self._working = 0
        self._waiting: list[_Ticket] = []
        self._idle_since: float | None = None  # when everyone at work came to wait, some of the last round missing
        self._last: set[int] = set()  # the caches the last round fed
        self.forwards = 0  # shared forwards run
        self.fed = 0  # sequences they fed
        self.retries = 0  # shared forwards that failed and were run again one sequence at a time

    def expect(self, count: int = 1) -> None:
        """`count` more sequences are at work (call before their threads start)."""
        with self._turn:
            self._working += count

    def done(self) -> None:
        """A sequence's work is over (finished or failed)."""
        with self._turn:
            self._working -= 1
            self._turn.notify_all()

    def forward(self, lm, cache, token_ids: list[int], positions: list[int], key_positions: list[int], *,
                attention_layers: list[int] | None = None, probes=None) -> ForwardResult:
        """`state.forward.forward`'s contract, shared with the other sequences at work."""
        if probes or getattr(cache, "store", "splice") == "ring":
            return forward_alone(lm, cache, token_ids, positions, key_positions, attention_layers=attention_layers,
                                 probes=probes)
        ticket = _Ticket(lm, prepare(lm, cache, token_ids, positions, key_positions, attention_layers=attention_layers))
        with self._turn:
            if self._working <= 0:  # it would wait for a round nobody counts it in
                raise RuntimeError("a forward from a thread the rendezvous was not told of (call expect() before "
                                   "the thread starts)")
            self._waiting.append(ticket)
            self._working -= 1
            self._turn.notify_all()
            while not ticket.done:
                wait = self._wait()
                if wait == 0:
                    self._run()
                else:
                    self._turn.wait(wait)
            self._working += 1
        if isinstance(ticket.result, BaseException):
            raise ticket.result
        return ticket.result

    def _wait(self) -> float | None:
        """(Holding the lock.) 0: run the round now; else how long to wait (None: until told).
        The linger counts from the moment nobody is at work: before that the round could not
        run anyway, and a sequence still at work is no reason to give up on one coming back."""
        if self._working or not self._waiting:
            self._idle_since = None
            return None
        missing = self._last - {id(ticket.part.cache) for ticket in self._waiting}
        if not missing or not self.linger:
            return 0
        if self._idle_since is None:
            self._idle_since = time.monotonic()
        return max(0.0, self._idle_since + self.linger - time.monotonic())

    def _run(self) -> None:
        """(Holding the lock.) Every waiting forward as one."""
        tickets, self._waiting = self._waiting, []
        lm = tickets[0].lm
        try:
            results = forward_many(lm, [ticket.part for ticket in tickets])
        except BaseException as error:
            if len(tickets) == 1:
                results = [error]
            else:  # each alone: only the sequence at fault fails
                self.retries += 1
                results = [_alone(ticket) for ticket in tickets]
        self.forwards += 1
        self.fed += len(tickets)
        self._idle_since = None
        self.on_forward(len(tickets))
        self._last = {id(ticket.part.cache) for ticket in tickets}
        for ticket, result in zip(tickets, results):
            ticket.result, ticket.done = result, True
        self._turn.notify_all()


def _alone(ticket: _Ticket) -> ForwardResult | BaseException:
    ticket.part.undo_appends()
    try:
        return forward_many(ticket.lm, [ticket.part])[0]
    except BaseException as error:
        return error
