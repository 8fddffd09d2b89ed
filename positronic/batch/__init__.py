"""Batched ticks: many sequences, one model forward per tick (see docs/batching.md).

    rounds.py      Rounds: several sequences' ticks in one thread, each a greenlet that pauses at
                   its forwards, which run as one once all are paused (what Batch runs)
    rendezvous.py  Rendezvous: the same for ticks in threads of their own (the server's jobs)
    brains.py      Batch: brains that join, tick together and leave
    threads.py     torch's threads per thread: all with one but the thread that runs the forwards

The forward itself (`forward_many`: one model run over several sequences' own caches) is the
state package's (positronic/state/batched.py): only the state writes a cache.
"""

from .brains import Batch
from ..state.batched import forward_many
from .rendezvous import Rendezvous
from .rounds import Rounds

__all__ = ["Batch", "Rendezvous", "Rounds", "forward_many"]
