"""torch's intra-op threads per thread: one OpenMP pool busy at a time.

On a CPU, torch's OpenMP (libgomp) gives every thread that runs a parallel op a pool of
threads of its own. Once the pools hold more threads than there are cores, libgomp stops
their spinning between ops, and each small matrix product waits for its threads to wake. A
forward of 8 rows ran at 0.55x its speed in a second thread of this project's 2-core box: 52
ms of linear layers against 30 ms in the thread that loaded the model. So the thread that
drives a batch's rounds (rounds.py) runs the forwards with torch's threads and the ticks' own
ops with one, and the helper threads it hands blocking parts to keep to one.

torch keeps the count per thread (OpenMP's), and gives a thread, on its first parallel op,
the count last set in any thread: a thread sets its own only after a first
`torch.get_num_threads()`, or that first op would overwrite it.
"""

from __future__ import annotations

import torch


def set_threads(count: int) -> None:
    """torch's intra-op threads in this thread (OpenMP keeps one count per thread)."""
    torch.get_num_threads()  # its first use sets the count (module docstring): before ours, not after
    torch.set_num_threads(count)
