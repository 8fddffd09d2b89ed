"""Dynamo's settings that every compiled part of the models shares (compiled.py's rounds and
small functions, weights.py's int8-weight-only product)."""

from __future__ import annotations

import torch

# graphs dynamo keeps for one function: for a round, one per model, recorded layers, buffer shape,
# bucket and torch thread count (a server has a few; a test process hundreds). Dynamo's own limit
# is 8 a function: past it, it would refuse to compile (fullgraph) and the caller would run eagerly
RECOMPILE_LIMIT = 4096


def lift_limits() -> None:
    """Dynamo's limit of graphs a function to `RECOMPILE_LIMIT`. Its settings are per thread
    (torch 2.13: per context, so per greenlet too): checked in the caller's every time (2 µs; a
    `config.patch` around the call cost 17)."""
    config = torch._dynamo.config
    if config.recompile_limit < RECOMPILE_LIMIT or config.accumulated_recompile_limit < RECOMPILE_LIMIT:
        config.recompile_limit = config.accumulated_recompile_limit = RECOMPILE_LIMIT
