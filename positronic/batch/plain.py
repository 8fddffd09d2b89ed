"""A plain round's work before its forward as one function of tensors.

In a plain round (`Engine._plain_round`: no sequence deletes a row) the host has two things to
compute before the forward: every sequence's greedy token from the last forward's logits, and
its press's next per-row state from that forward's shares. Eagerly that is some forty torch
operations (the recent tokens' gather, the repetition penalty's gather, where and scatter, the
argmax, the press's arithmetic), each a kernel launch on a GPU. `prelude` is the same work as one
function of tensors, and `PRELUDES` compiles it (inductor: one fused kernel or a few, and one
Python call) for the engine's compiled rounds, where every sequence has one kind of press and
one penalty, the usual case; anything else runs the same pieces eagerly.

Shapes are the forward's buckets (models/compiled.py): the first `bucket` slots' tensors, the
padding slots' results computed from whatever they hold and thrown away, so joins and leaves
never make a graph again. Numbers: elementwise work compiled on a CPU is eager's to the bit
(inductor compiles C++ without contracting products into FMAs); tests/positronic/batch/test_plain.py
holds each plain press's compiled prelude to the eager one's bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from positronic.steps.sample import greedy_tensor

from ..models.compiled import Functions
from ..presses import Rows


def recent_ids(token_ids: Tensor, length: Tensor, window: int) -> Tensor:
    """[S, window] token ids: each sequence's last `window` rows' (a sequence with fewer repeats
    its row 0, which is penalised once either way). token_ids [S, N], length [S]."""
    rows = length[:, None] - window + torch.arange(window, device=length.device)
    return token_ids.gather(1, rows.clamp(min=0))


def prelude(press, window: int, penalty: float, logits: Tensor, length: Tensor, positions: Tensor,
            token_ids: Tensor, shares: Tensor, pinned: Tensor, states: dict[str, Tensor], clocks: Tensor
            ) -> tuple[Tensor, dict[str, Tensor]]:
    """S greedy sequences of one press and one penalty: their tokens [S] int64 (`steps.greedy_many`'s
    picks, logits [S, vocab] known finite) and the press's next row state ({name: [S, N]}, what
    `press.score` gives for rows `length`, `positions`, `token_ids`, `shares`, `pinned` [S, N] and
    the rounds scored `clocks` [S])."""
    tokens = greedy_tensor(logits, recent_ids(token_ids, length, window), [penalty] * logits.shape[0])
    _, scored = press.score(Rows(length=length, positions=positions, shares=shares, pinned=pinned), states, clocks)
    return tokens, scored


def fits(press) -> bool:
    """Whether `press`'s score compiles as one graph: rows shared by every lane and no reads of
    keys (knorm's reads the rows it has not read yet, a number of them known only then)."""
    return press.lanes == 1 and not press.reads_keys


# shared by every engine of a process: one graph per kind of press, penalty window, penalty and bucket
PRELUDES = Functions("a plain round's prelude")
