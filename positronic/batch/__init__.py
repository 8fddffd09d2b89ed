"""Batched ticks: many sequences, one model forward per tick (see docs/batching.md).

    forward.py     forward_many: one forward over several sequences' own caches (BatchCache, Ragged attention)
    rendezvous.py  Rendezvous: where the ticks of several sequences meet for that forward
    brains.py      Batch: brains that join, tick together and leave
"""

from .brains import Batch
from .forward import forward_many
from .rendezvous import Rendezvous

__all__ = ["Batch", "Rendezvous", "forward_many"]
