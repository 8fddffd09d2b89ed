"""A plain round's work before its forward as one function of tensors.

In a plain round (`Engine._plain_round`: no sequence deletes a row) the host has two things to
compute before the forward: every sequence's greedy token from the last forward's logits, and
its press's next per-row state from that forward's shares. Eagerly that is some forty torch
operations (the recent tokens' gather, the repetition penalty's gather, where and scatter, the
argmax, the press's arithmetic), each a kernel launch on a GPU. `prelude` is the same work as one
function of tensors, and `Preludes` compiles it (inductor: one fused kernel or a few, and one
Python call) for the engine's compiled rounds, where every sequence has one kind of press and
one penalty, the usual case; anything else runs the same pieces eagerly.

Shapes are the forward's buckets (models/compiled.py): the first `bucket` slots' tensors, the
padding slots' results computed from whatever they hold and thrown away, so joins and leaves
never make a graph again. Numbers: elementwise work compiled on a CPU is eager's to the bit
(inductor compiles C++ without contracting products into FMAs); tests/positronic/batch/test_plain.py
holds each plain press's compiled prelude to the eager one's bits.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from positronic.steps.sample import greedy_tensor

from ..models.compiled import lift_limits
from ..presses import Rows

log = logging.getLogger(__name__)


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


class Preludes:
    """`prelude` compiled once per kind of press, penalty window, penalty and bucket, shared by
    every engine of a process; `compiles` counts the graphs made."""

    def __init__(self):
        self._compiled: dict[tuple, object] = {}
        self.compiles = 0
        self.broken: str | None = None  # why compiled preludes stopped (they run eagerly then)

    @staticmethod
    def fits(press) -> bool:
        """Whether `press`'s score compiles as one graph: rows shared by every lane and no reads
        of keys (knorm's reads the rows it has not read yet, a number of them known only then)."""
        return press.lanes == 1 and not press.reads_keys

    def __call__(self, press, window: int, penalty: float, *tensors) -> tuple[Tensor, dict[str, Tensor]]:
        """`prelude(press, window, penalty, *tensors)`, compiled (eagerly under a dispatch mode, as
        the compiled round runs, and for good once a compile has failed)."""
        if torch._C._len_torch_dispatch_stack() or self.broken is not None:
            return prelude(press, window, penalty, *tensors)
        key = (press.group, window, penalty)
        run = self._compiled.get(key)
        if run is None:
            def run(*tensors, press=press):
                return prelude(press, window, penalty, *tensors)
            run = self._compiled[key] = torch.compile(run, fullgraph=True, dynamic=False, backend=self._backend)
        lift_limits()
        try:
            return run(*tensors)
        except Exception as exc:  # nothing was written: this round and the ones after run it eagerly
            self.broken = f"{type(exc).__name__}: {exc}"
            log.warning("a compiled prelude failed (%s); plain rounds run it eagerly from now on", self.broken)
            return prelude(press, window, penalty, *tensors)

    def _backend(self, graph, inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        clock = time.perf_counter()
        compiled = compile_fx(graph, inputs)
        log.info("compiled a plain round's prelude in %.1f s", time.perf_counter() - clock)
        return compiled


PRELUDES = Preludes()
