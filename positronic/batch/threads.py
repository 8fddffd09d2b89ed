"""torch's intra-op threads per thread, for a batch whose forwards all run in one thread.

On a CPU, torch's OpenMP (libgomp) gives every thread that runs a parallel op a pool of
threads of its own. Once the pools hold more threads than there are cores, libgomp stops
their spinning between ops, and each small matrix product waits for its threads to wake. A
forward of 8 rows then ran at 0.55x its speed in a second thread of this project's 2-core
box: 52 ms of linear layers against 30 ms in the thread that loaded the model. So one thread
(a Rendezvous's runner) runs every forward with torch's threads, and every other thread that
touches tensors keeps to one: one pool in the process.

torch keeps the count per thread (OpenMP's), and gives a thread, on its first parallel op,
the count last set in any thread: a thread sets its own only after a first
`torch.get_num_threads()`, or that first op would overwrite it.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def one_thread(others: int):
    """torch's intra-op threads are one in this thread while active (a sequence's thread in a
    batch with a runner: its forwards run in the runner, the rest is small ops). `others`: the
    runner's count, put back on the way out as the count of threads yet to start (torch gives
    a thread, on its first parallel op, the count last set in any thread)."""
    set_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(others)


def set_threads(count: int) -> None:
    """torch's intra-op threads in this thread (OpenMP keeps one count per thread)."""
    torch.get_num_threads()  # its first use sets the count (module docstring): before ours, not after
    torch.set_num_threads(count)
