"""Checks that the cache and the mirror agree, and how far a cached row may lie from a fresh
computation of it: float arithmetic alone, or with a 4-bit kv_format its rounding bound
(`rounding_bounds`: more for keys re-rotated since they were written)."""

from __future__ import annotations

import torch

from ..kv import formats as kv_formats
from . import rows as row_plans
from .actions import ActionError
from .forward import fresh_layer0_kv, prefill


class StateInvariantError(AssertionError):
    """The cache and the mirror disagree."""


def rounding_bounds(requantized):
    """How far a 4-bit key re-rotated `requantized` times (int or int tensor) may lie from
    the exact key, in rounding bounds of its present scale (kv_formats.PackedFormat.error_bound):
    2^(r+1) - 1, so 1, 3, 7, 15 ... A re-rotation turns the error it had (at most sqrt(2)
    times larger per element, measured against a scale at least 1/sqrt(2) of the old one:
    2x) and rounds again (+1): F(r) = 2 F(r-1) + 1, F(0) = 1. A worst case; measured on
    SmolLM2's keys: 2.3, 3.4, 5.4, 9.6 bounds after 1, 2, 4, 8 (bench/kv_formats.py). Values
    are never re-rotated: 1."""
    return 2 ** (requantized + 1) - 1


def float_tolerance(lm) -> float:
    """What float arithmetic alone may change in a layer-0 row (a batched forward against
    a fresh one)."""
    return 1e-4 if lm.dtype == torch.float32 else 2e-2


def layer0_tolerance(lm, kv_format: str, layer0, rows: torch.Tensor, requantized: torch.Tensor | int = 0,
                     positions=None, head: int | None = None) -> torch.Tensor | float:
    """How far cache rows [..., n, head_dim] (as read: decoded) may lie from a fresh
    computation of layer 0 (`layer0`: the cache's layer 0), per element: the float tolerance,
    plus with a 4-bit kv_format the format's rounding bound of each row (a tensor [..., n, 1]) times

        int4 / fp4: `rounding_bounds(requantized)` (an int, or [n] per row)
        int4h:      1 + requantized (re-rotation is exact; a restored row was rounded once
                    before), the bound of the row's coded form: keys at `positions` [n],
                    values with `positions` None (kv_formats.Int4H.error_bound).
    `head`: the rows are that kv head's alone ([..., 1, n, head_dim], a lane of per-lane rows)."""
    codec = kv_formats.packed(kv_format)
    if codec is None:
        return float_tolerance(lm)
    requantized = torch.as_tensor(requantized, dtype=torch.float32, device=rows.device).reshape(-1, 1)
    if kv_format == "int4h":
        as_cached = rows.reshape(1, layer0.kv_heads if head is None else 1, -1, layer0.head_dim)
        coded = (layer0.coded_values(as_cached) if positions is None
                 else layer0.coded_keys(as_cached, torch.as_tensor(positions, dtype=torch.long), head))
        bound = codec.error_bound(coded).reshape(*rows.shape[:-1], 1)
        return float_tolerance(lm) + (1 + requantized) * bound
    return float_tolerance(lm) + rounding_bounds(requantized) * codec.error_bound(rows)


def layer0_excess(lm, kv_format: str, layer0, cached: torch.Tensor, fresh: torch.Tensor,
                  tolerance: float | None = None, requantized: torch.Tensor | int = 0,
                  positions=None, head: int | None = None) -> tuple[float, float] | None:
    """(error, tolerance) at the element of `cached` that lies farthest beyond its
    tolerance from `fresh` (both [..., rows, head_dim]), or None when all are within.
    `tolerance`: one number for every element instead of `layer0_tolerance`; keys pass
    their `positions`; `head`: the rows are that kv head's alone."""
    if not cached.numel():
        return None
    allowed = (layer0_tolerance(lm, kv_format, layer0, cached, requantized, positions, head)
               if tolerance is None else tolerance)
    error = (cached.float() - fresh.float()).abs()
    allowed = torch.as_tensor(allowed, dtype=torch.float32, device=error.device).expand_as(error)
    worst = int((error - allowed).argmax())
    error, allowed = error.flatten()[worst].item(), allowed.flatten()[worst].item()
    return (error, allowed) if error > allowed else None


def check(state, cache, mirror, predicted: list[int], requantized: list[int], *, deep: bool = False,
          tolerance: float | None = None) -> None:
    """Raise StateInvariantError unless `state` (a StateManager) and its blades `cache` and
    `mirror` agree (`predicted`, `requantized`: its per-row lists); see StateManager.check."""
    lm = state.lm
    if state.broken:
        raise StateInvariantError(state.broken)
    mirror.check(lm.max_positions)
    rows, cached = len(mirror), state.rows_per_layer
    if cache.length != cached or len(predicted) != rows or len(requantized) != rows:
        raise StateInvariantError(f"cache holds {cache.length} rows ({len(predicted)} predictions) "
                                  f"but the mirror {cached} per layer ({rows} live)")
    rings = {getattr(layer, "ring", None) for layer in cache.layers}
    if rings != {mirror.ring}:
        raise StateInvariantError(f"the mirror records the ring {mirror.ring}, the cache's layers hold {rings}")
    if cache.positions is not None and cached:  # int4h rotates every key to these when it reads it
        if state.per_layer:
            held, expected = cache.positions.lanes, row_plans.lane_positions(mirror)
            held = None if held is None else [row[:cached] for row in held.reshape(-1, held.shape[-1]).tolist()]
        else:
            held, expected = cache.positions.tensor, mirror.positions()
            held = None if held is None or len(held) < cached else held[:cached].tolist()
        if held != expected:
            raise StateInvariantError("the cache's row positions (where int4h rotates its keys to) differ from "
                                      "the mirror's")
    shape = (1, lm.num_kv_heads, cached, lm.head_dim)
    for index, layer in enumerate(cache.layers):
        if layer.length != cached or (cached and (tuple(layer.keys.shape) != shape or tuple(layer.values.shape) != shape)):
            raise StateInvariantError(f"layer {index} holds {layer.length} rows "
                                      f"({None if layer.keys is None else tuple(layer.keys.shape)}), expected {shape}")
    if deep and rows:
        layer = cache.layers[0]
        token_ids, positions = mirror.live_token_ids(), mirror.positions()
        fresh_keys, fresh_values = fresh_layer0_kv(lm, token_ids, positions)  # [1, kv_heads, live, head_dim]
        found = []
        heads = state.lanes_per_layer
        for lane in range(heads):  # layer 0's lanes, each with its own rows
            head = slice(None) if heads == 1 else slice(lane, lane + 1)
            rows_of = mirror.layer_rows_of(lane) if state.per_layer else list(range(rows))
            index = torch.tensor(rows_of, dtype=torch.long, device=fresh_keys.device)
            one = None if heads == 1 else lane  # the lane's kv head, when a lane is one
            found += [layer0_excess(lm, state.kv_format, layer, layer.keys[:, head],
                                    fresh_keys[:, head].index_select(2, index), tolerance,
                                    torch.tensor([requantized[r] for r in rows_of]), [positions[r] for r in rows_of],
                                    head=one),
                      layer0_excess(lm, state.kv_format, layer, layer.values[:, head],
                                    fresh_values[:, head].index_select(2, index), tolerance, head=one)]
        if worst := max((f for f in found if f is not None), default=None):
            error, allowed = worst
            raise StateInvariantError(f"layer 0 differs from a fresh prefill by {error:.2e} (> {allowed:.2g})")


def divergence(lm, scratch, token_ids: list[int], positions: list[int], next_logits: torch.Tensor) -> float:
    """KL(fresh ‖ spliced) in nats of the next-token distribution: `next_logits` against a
    prefill of the same live tokens at the same positions into `scratch`, an empty cache."""
    scratch.set_positions(positions)
    fresh = prefill(lm, scratch, token_ids, positions).logits
    log_fresh, log_spliced = fresh.log_softmax(-1), next_logits.log_softmax(-1)
    return float((log_fresh.exp() * (log_fresh - log_spliced)).sum())


def checked_stored_rows(lm, kv_format: str, layer0, ledger, stored: dict, live: dict[int, int] | None = None) -> dict:
    """Restored rows' own K/V (ledger id -> (keys, values [layers, kv_heads, head_dim],
    predicted)) checked against the model: the shape of a cache row, and layer 0 equal to a
    fresh computation of the token at its position (layer 0 depends on nothing else), so K/V
    recorded for another token or position are refused (ActionError). Returns
    them in the model's dtype and device. `live`: ledger id -> position of tokens still live
    (per-layer rows: a lane takes back a token that other lanes hold)."""
    if not stored:
        return {}
    ids = list(stored)
    shape = (lm.num_layers, lm.num_kv_heads, lm.head_dim)
    for ledger_id in ids:
        keys, values, _ = stored[ledger_id]
        if tuple(keys.shape) != shape:
            raise ActionError(f"restore: ledger id {ledger_id}'s K/V are {tuple(keys.shape)} per row, "
                        f"the model's cache rows are {shape} (layers, kv_heads, head_dim)")
    keys = torch.stack([stored[i][0] for i in ids], dim=2).to(lm.device, lm.dtype)
    values = torch.stack([stored[i][1] for i in ids], dim=2).to(lm.device, lm.dtype)
    positions = [(live or {}).get(i, ledger[i].position) for i in ids]
    if None in positions:
        raise ActionError(f"restore: ledger id {ids[positions.index(None)]} has no recorded position")
    fresh_keys, fresh_values = fresh_layer0_kv(lm, [ledger[i].token_id for i in ids], positions)
    # a 4-bit key may have been re-rotated once before it was recorded (more is rare)
    found = [layer0_excess(lm, kv_format, layer0, keys[0], fresh_keys[0], requantized=1, positions=positions),
             layer0_excess(lm, kv_format, layer0, values[0], fresh_values[0])]
    if worst := max((f for f in found if f is not None), default=None):
        raise ActionError(f"restore: the given K/V differ from the tokens' own at their positions in layer 0 "
                    f"by {worst[0]:.2e}: they were recorded for other tokens or positions")
    return {i: (keys[:, :, k], values[:, :, k], stored[i][2]) for k, i in enumerate(ids)}
