"""A plain round's writes (positronic/state/plain.py): compiled, the eager writes' bits, in every
tensor of the state, over a bucket wider than the active slots."""

from __future__ import annotations

import functools

import torch

from positronic.batch.engine import Engine
from positronic.brain.loop import Brain, BrainConfig
from positronic.state.plain import SETTLES, settle

TEXT = list(range(3, 240, 3))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({4: torch.int32, 8: torch.int64}[tensor.element_size()]) if tensor.is_floating_point() else tensor


def test_the_compiled_writes_are_the_eager_writes_bit_for_bit(tiny):
    """Three brightness sequences a few rounds in, in a compiled state of 4 slots (a round's
    bucket of 4: one padding slot): one forward's results written by `settle` eagerly into
    copies of the state's tensors and compiled into the tensors themselves leave the same bits
    everywhere, and the same finiteness."""
    config = BrainConfig(policy="brightness", budget=48, temperature=0, seed=3)
    engine = Engine(tiny, slots=4, capacity=64, compiled=True)
    for k in range(3):
        engine.join(k, Brain.start(tiny, [tiny.bos_id] + TEXT[5 * k : 5 * k + 20], config))
    for _ in range(3):
        engine.step()
    state = engine.state
    known = state.known()
    tokens = torch.tensor([11, 12, 13, 0])
    new_rows = torch.tensor(known.lengths + [0])
    position = torch.tensor(known.reach + [0])
    results = state._forward(tokens, new_rows, position)
    fills = tuple((name, state.row_fill[name]) for name in state.row_state if name != "predicted")
    names = ("length", "positions", "token_ids", "next_logits", "attention", "shares", "lane_shares", "lane_peaks",
             "queries", "log_norms")
    scored = {"brightness.brightness": state.row_state["brightness.brightness"][:4] * 0.5 + 1}
    copies = {name: getattr(state, name).clone() for name in names}
    rows = {name: values.clone() for name, values in state.row_state.items()}
    want = settle(fills, tokens, new_rows, position, results, copies, rows, scored)
    made = SETTLES(fills, functools.partial(settle, fills), tokens, new_rows, position, results,
                   {name: getattr(state, name) for name in names}, state.row_state, scored)
    assert SETTLES.broken is None and torch.equal(made, want) and bool(made.all())
    for name in names:
        assert torch.equal(bits(getattr(state, name)), bits(copies[name])), name
    for name in rows:
        assert torch.equal(bits(state.row_state[name]), bits(rows[name])), name
    assert state.length[:3].tolist() == [length + 1 for length in known.lengths]
    assert state.token_ids[range(3), 0, new_rows[:3]].tolist() == [11, 12, 13]
