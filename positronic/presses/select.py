"""The one batched selection (Step 3b for S sequences at once): which rows a round deletes.

`select` is `Policy.free(view, values, need, repair=False)` of positronic/policies/base.py
without a repairer, on [S, N] tensors: the lowest units first (`steps.select_units`), then
single rows where fragmented units could not free enough. Rows are compact: rows 0..length-1
of a sequence are live, the rest padding, which no mask here ever lets through.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def bounds(length: Tensor, prefix: int, window: Tensor) -> tuple[Tensor, Tensor]:
    """start, stop [S]: the selectable rows [start, stop) of each sequence, as
    `steps.selectable_rows`: after the first `prefix` = max(sinks, protect) rows and before
    the last `window[s]` rows; empty (start == stop) when those cover everything."""
    start = length.clamp(max=prefix)
    return start, torch.maximum(start, length - window)


def select(values: Tensor, length: Tensor, need: Tensor, start: Tensor, stop: Tensor, pinned: Tensor,
           unit: int) -> Tensor:
    """deleted [S, N] bool: at least need[s] rows of sequence s (fewer only when too few are
    selectable), none pinned, all in [start[s], stop[s]).

    values [S, N] float64 (lower = less worth keeping; junk past length, never NaN in a
    live row); length, need, start, stop [S] int64; pinned [S, N] bool. Units of `unit`
    adjacent rows are taken greedily, a unit as bright as its brightest row, lowest first,
    ties to the lower row, until need[s] rows are freed; if they run out, the lowest single
    rows left make up the rest."""
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1:
        raise ValueError(f"unit must be an int >= 1, got {unit!r}")
    row = torch.arange(values.shape[1], device=values.device)
    open_rows = (row >= start[:, None]) & (row < torch.minimum(stop, length)[:, None]) & ~pinned
    need = need.clamp(min=0)
    taken = _units(values, open_rows, need, unit) if unit > 1 else torch.zeros_like(open_rows)
    return taken | lowest_rows(values, open_rows & ~taken, need - taken.sum(dim=1))


def lowest_rows(values: Tensor, candidate: Tensor, count: Tensor) -> Tensor:
    """[S, N] bool: the count[s] lowest candidate rows of each sequence, ties to the lower row
    (all candidates when there are fewer; none for count <= 0). One stable sort: a row's rank
    is its place among the candidates in (value, row) order."""
    key = torch.where(candidate, values, math.inf)  # a candidate's own +inf still ranks by row: see `ranked`
    order = torch.sort(key, dim=1, stable=True).indices
    ranked = candidate.gather(1, order)  # candidates in (value, row) order; the rest only pad the order
    chosen = ranked & (ranked.cumsum(dim=1) <= count[:, None])
    return torch.zeros_like(candidate).scatter(1, order, chosen)


def _units(values: Tensor, open_rows: Tensor, need: Tensor, unit: int) -> Tensor:
    """[S, N] bool: the rows of the units greedy selection takes, one unit per sequence per
    step, each sequence until it has freed need[s] rows or no unit fits. Taking the lowest
    fitting unit each step is the heap of `steps.select_units`: a unit it skips (it overlaps
    a taken row) never fits again, so popping the heap and re-taking the minimum agree."""
    rows = values.shape[1]
    taken = torch.zeros_like(open_rows)
    if unit > rows:
        return taken
    brightest = values.unfold(1, unit, 1).amax(dim=2)  # [S, N - unit + 1]: unit p is rows p..p+unit-1
    row = torch.arange(rows, device=values.device)
    while True:
        closed = F.pad((~open_rows | taken).cumsum(dim=1), (1, 0))  # [S, N + 1]: closed rows before each row
        fits = (closed[:, unit:] == closed[:, :-unit]) & (taken.sum(dim=1) < need)[:, None]
        found = fits.any(dim=1)
        if not found.any():
            return taken
        lowest = torch.where(fits, brightest, math.inf).amin(dim=1, keepdim=True)
        first = (fits & (brightest == lowest)).int().argmax(dim=1)  # argmax: the first True, the lower row
        taken = taken | ((row >= first[:, None]) & (row < first[:, None] + unit) & found[:, None])
