"""The one place where the cache layers allocate buffers.

Every K/V buffer, every part of a packed row, the shared scratch and the ring's slots are
made by `empty`, uninitialised (`torch.empty`): a row is written before it is read, so
filling would only cost time.

`POSITRONIC_NAN_FILL=1` in the environment (a test mode: `make test` runs the cache, state,
session, ring, recall and format suites under it) fills each new buffer with garbage that
cannot pass unnoticed: NaN in a float buffer, the dtype's largest value in an integer one (an
int4h zero point of 255 lies outside 0..15; an int32 word of codes has no value out of range,
but its row's scales are NaN). A read of a slot nobody wrote then turns a logit into NaN
instead of whatever `torch.empty` happened to hold.
"""

from __future__ import annotations

import os

import torch

NAN_FILL = "POSITRONIC_NAN_FILL"


def nan_fill() -> bool:
    """Whether the NaN-fill test mode is on (read at each allocation: tests may set it)."""
    return os.environ.get(NAN_FILL) == "1"


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A new buffer of `shape`: uninitialised, or garbage in the NaN-fill test mode."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    if nan_fill():
        buffer.fill_(garbage(dtype))
    return buffer


def rows_like(like: torch.Tensor, capacity: int) -> torch.Tensor:
    """A new buffer [1, kv_heads, capacity, width] for rows shaped, typed and placed like `like`
    [..., kv_heads, n, width]."""
    return empty((1, like.shape[1], capacity, like.shape[-1]), like.dtype, like.device)


def garbage(dtype: torch.dtype):
    """What the NaN-fill mode writes into a new buffer of `dtype`."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max
