"""Batched ticks: many sequences, one model forward per tick (see docs/batching.md).

    rounds.py   Rounds: several sequences' works as greenlets of one thread, each pausing at its
                forwards, which run as one once all are paused (Batch.step's ticks, the server's
                requests); offload/wait for a work's blocking parts; WorkLock
    brains.py   Batch: brains that join, tick together and leave (seated in engines where they run)
    seats.py    Seats: which engine a brain sits in; a round's TickRecord
    engine.py   Engine: Core v4's rounds (docs/core.md)
    threads.py  torch's threads per thread

The forward itself (`forward_many`: one model run over several sequences' own caches) is the
state package's (positronic/state/batched.py): only the state writes a cache.
"""

from .brains import Batch
from ..state.batched import forward_many
from .rounds import Rounds, WorkLock, offload, wait

__all__ = ["Batch", "Rounds", "WorkLock", "forward_many", "offload", "wait"]
