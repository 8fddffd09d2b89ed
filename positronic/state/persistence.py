"""Saving and resuming a state: `tensors` lists what a session saves besides the mirror,
`from_saved` loads it back into a new StateManager (rows loaded, not recomputed, so a resumed
run goes on exactly as it would have)."""

from __future__ import annotations

import torch

from ..kv import formats as kv_formats
from . import rows as row_plans

NEWEST = ("next_logits", "last_attention", "last_query", "last_log_norm")  # what the forward of the last row leaves


def lane_counts(lm) -> tuple[int, int]:
    """The lane counts per-layer rows may have: one per layer, or one per kv head of each layer."""
    return lm.num_layers, lm.num_layers * lm.num_kv_heads


def check_fits(lm, mirror) -> None:
    """ValueError unless `mirror`'s live rows fit `lm`: positions within its limit, token ids
    inside its vocabulary (a mirror saved with another model must not reach the embedding)."""
    mirror.check(lm.max_positions)
    if any(not 0 <= t < lm.vocab_size for t in mirror.live_token_ids()):
        raise ValueError(f"a live token id lies outside {lm.name}'s vocabulary 0..{lm.vocab_size - 1}")


def from_saved(cls, lm, mirror, tensors: dict[str, torch.Tensor], *, capacity: int = 0, score_layers="last",
               brightness: float = 255.0, kv_format: str = "float", kv_store: str = "splice"):
    """A `cls` (StateManager) resumed from a saved mirror and the cache it described (`tensors()`
    of the state that was saved): the rows are loaded, not recomputed, so the run goes on
    exactly as it would have. Raises ValueError naming what does not fit (a shape, a dtype, a
    token outside the vocabulary) before anything is allocated, and StateInvariantError if
    layer 0 does not match a fresh computation of the mirror's tokens at their positions. An
    int4 or fp4 cache saves its rows decoded (`tensors`) and encodes them again here: in
    float32 that gives back the same codes and scales (kv_formats.PackedFormat.decode); int4h
    saves its codes. A ring store's rows are saved in row order and go back into the slots
    the mirror records (its cursor)."""
    check_fits(lm, mirror)
    if mirror.layers is not None and mirror.layers.num_layers not in lane_counts(lm):
        raise ValueError(f"per-layer rows for {mirror.layers.num_layers} lanes need a model with as many layers, "
                         f"or layers times kv heads ({lm.name}: {lm.num_layers} layers of {lm.num_kv_heads} kv heads)")
    manager = cls(lm, mirror, capacity=capacity, score_layers=score_layers, new_brightness=brightness,
                  kv_format=kv_format, kv_store=kv_store)
    rows, cached = len(mirror), manager.rows_per_layer
    # the format's own tensors (float, int4, fp4: keys and values; int4h: its parts as stored)
    rows_saved = {name: (shape[:2] + (cached,) + shape[2:], dtype) for name, (shape, dtype)
                  in manager._cache.saved_parts(lm.num_kv_heads, lm.head_dim, lm.dtype).items()}
    expected = {
        **rows_saved,
        "predicted": ((rows,), torch.int64),
        "next_logits": ((lm.vocab_size,), torch.float32),
        "last_attention": ((len(manager.attention_layers), lm.num_heads, cached), torch.float32),
        "last_query": ((len(manager.attention_layers), lm.num_heads, lm.head_dim), torch.float32),
        "last_log_norm": ((len(manager.attention_layers), lm.num_heads), torch.float32),
        "requantized": ((rows,), torch.int64),  # 4-bit formats only
    }
    if unknown := sorted(set(tensors) - set(expected)):
        raise ValueError(f"unknown saved tensors: {unknown}")
    for name, (shape, dtype) in expected.items():
        tensor = tensors.get(name)
        if tensor is None and (name in NEWEST or name == "requantized"):
            continue  # the last edit did not write the newest row; a float cache rounds nothing
        if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            found = "missing" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
            raise ValueError(f"saved tensor {name!r} is {found}, expected {shape} {dtype} for {rows} live rows"
                             + (f" ({cached} per layer)" if cached != rows else ""))
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"saved tensor {name!r} holds non-finite values")
    predicted = tensors["predicted"]
    if rows and not bool(((predicted >= 0) & (predicted < lm.vocab_size)).all()):
        raise ValueError("saved predictions lie outside the vocabulary")
    requantized = tensors.get("requantized", torch.zeros(rows, dtype=torch.int64))
    if rows and not bool(((requantized >= 0) & (requantized <= 60)).all()):
        raise ValueError("saved re-rotation counts must lie in 0..60")
    if rows:
        manager._cache.check_saved({name: tensors[name] for name in rows_saved})
    manager._cache.set_positions(manager._mirror.live.positions)
    manager._cache.load({name: tensors[name] for name in rows_saved}, lm.dtype, lm.device)
    if manager.per_layer:  # int4h: each lane's keys are read at its own rows' positions
        manager._cache.set_lane_positions(row_plans.lane_positions(manager._mirror))
    manager._predicted = predicted.tolist()
    manager._requantized = requantized.tolist()
    for name in NEWEST:
        if name in tensors:
            setattr(manager, name, tensors[name].to(lm.device))
    manager.check(deep=True)
    return manager


def tensors(manager) -> dict[str, torch.Tensor]:
    """What `from_saved` needs besides the mirror, as CPU copies:
    keys, values [layers, kv_heads, rows, head_dim] (model dtype; an int4 or fp4 cache's rows
    decoded), or for int4h its rows as stored: key_ and value_codes int32 [layers, kv_heads,
    rows, head_dim // 8], _scales float16 and _zeros uint8 [layers, kv_heads, rows, groups];
    predicted [rows] int64;
    next_logits [vocab], last_attention [scored layers, heads, rows], last_query and
    last_log_norm float32 when the last edit left them; with a 4-bit format requantized
    [rows] int64 (how often each key was re-rotated, for the deep check's tolerance)."""
    manager._refuse_if_broken("save")
    lm, cache = manager.lm, manager._cache
    saved = {"predicted": torch.tensor(manager._predicted, dtype=torch.int64)}
    if kv_formats.packed(manager.kv_format):
        saved["requantized"] = torch.tensor(manager._requantized, dtype=torch.int64)
    saved.update(cache.saved(lm.num_kv_heads, lm.head_dim, lm.dtype))
    for name in NEWEST:
        if getattr(manager, name) is not None:
            saved[name] = getattr(manager, name).detach().float().cpu().contiguous()
    return saved
