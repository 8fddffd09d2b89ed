"""Batched ticks: many sequences, one model forward per tick (see docs/batching.md).

    rendezvous.py  Rendezvous: where the ticks of several sequences meet for that forward
    brains.py      Batch: brains that join, tick together and leave
    threads.py     torch's threads per thread: all with one but the thread that runs the forwards

The forward itself (`forward_many`: one model run over several sequences' own caches) is the
state package's (positronic/state/batched.py): only the state writes a cache.
"""

from .brains import Batch
from ..state.batched import forward_many
from .rendezvous import Rendezvous

__all__ = ["Batch", "Rendezvous", "forward_many"]
