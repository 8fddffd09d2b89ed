"""Step 1: turn the newest next-token logits into one sampled token.

Pure function: the caller owns the generator, so a seeded run is reproducible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

GREEDY_BELOW = 1e-3  # temperatures at or below this mean argmax
# above this every finite float32 logit divides to ~0 (a uniform draw among the finite ones), and
# dividing by it keeps -inf at -inf (a larger float32 would round to inf, and -inf / inf is NaN)
TEMPERATURE_CAP = 1e30
TOP_N = 20  # how many candidates the tick record keeps


class NonFiniteLogits(ValueError):
    """The logits hold NaN or +inf, or no finite value at all: no distribution to draw from.

    Logits like that come from a cache holding garbage (a row read that was never written, a
    NaN that spread), not from the model: the caller rebuilds the state from the mirror and
    draws again (`Brain.step`) rather than let softmax turn them into a NaN token. A -inf logit
    is fine (a token that can never be drawn), as long as one is finite."""


@dataclass(frozen=True)
class Sample:
    """The sampled token and the top-20 candidates (id, probability), most likely first.

    `top` is the distribution after repetition penalty and temperature but before
    top-k / top-p filtering, so it shows what the model wanted, not what survived.
    """

    token_id: int
    top: list[tuple[int, float]]


def sample(
    logits: Tensor,
    *,
    temperature: float = 0.7,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    recent_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> Sample:
    """Sample one token id from `logits` (shape [vocab], any float dtype).

    - temperature <= 1e-3: greedy, ties to the lowest id.
    - top_k: keep the k most likely tokens (0 = off).
    - top_p: keep the smallest most-likely set whose probability reaches top_p (1.0 = off);
      applied after top_k, on the renormalised survivors; never empties the set.
    - repetition_penalty (CTRL / Hugging Face): for each distinct id in `recent_ids`,
      a positive logit is divided by the penalty, a non-positive one multiplied.
    - generator: a CPU `torch.Generator`; the same seed gives the same token.

    Raises NonFiniteLogits if `logits` hold NaN or +inf or nothing finite (before drawing: the
    generator is untouched), ValueError for bad arguments. Never returns a token from an empty
    candidate set: the most likely token always survives top_k and top_p.
    """
    _validate(logits, temperature, top_k, top_p, repetition_penalty)
    # One small vector per tick: float32 on the CPU avoids float16 overflow/rounding in
    # softmax and lets a CPU generator drive the draw whatever device the model is on.
    x = logits.detach().to("cpu", torch.float32).clone()
    vocab = x.numel()
    top_logit = x.max()  # NaN if any is NaN
    if not bool(torch.isfinite(top_logit)):
        raise NonFiniteLogits(f"the logits hold {'NaN' if bool(x.isnan().any()) else 'inf or no finite value'}: "
                              f"their largest is {float(top_logit)}")

    if recent_ids and repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(int(i) for i in recent_ids)), dtype=torch.long)
        if ids[0] < 0 or ids[-1] >= vocab:
            raise ValueError(f"recent_ids must lie in [0, {vocab}), got {ids.tolist()}")
        picked = x[ids]
        penalised = torch.where(picked > 0, picked / repetition_penalty, picked * repetition_penalty)
        # a penalty beyond float32's range: a positive logit divided stays the largest float32
        # (not inf), a zero times an infinite penalty stays 0 (not NaN)
        x[ids] = penalised.nan_to_num(nan=0.0, posinf=torch.finfo(torch.float32).max, neginf=-math.inf)

    greedy = temperature <= GREEDY_BELOW
    probs = torch.softmax(x if greedy else x / min(temperature, TEMPERATURE_CAP), dim=-1)
    # Only the candidates that can matter are sorted (a full sort of a 50k vocabulary is
    # ~5 ms, a tenth of a decode step): the top 20 for the record, top_k when it is on.
    wanted = vocab if (not greedy and not top_k) else max(TOP_N, 0 if greedy else top_k)
    if not greedy and bool(probs[0].isnan()):  # a logit divided by a small temperature overflowed to inf
        probs = torch.softmax((x - top_logit) / temperature, dim=-1)  # the largest is 0: only -inf can come out
    sorted_probs, order = _largest(probs, wanted)
    top = [(int(i), float(p)) for i, p in zip(order[:TOP_N], sorted_probs[:TOP_N])]

    if greedy:
        # argmax on the logits, not the probabilities: softmax can round distinct
        # large logits to the same probability.
        return Sample(token_id=int(torch.argmax(x)), top=top)

    keep = sorted_probs.clone()
    if top_k:
        keep[top_k:] = 0.0
    if top_p < 1.0:
        keep = keep / keep.sum()
        before = torch.cumsum(keep, dim=-1) - keep  # mass of strictly more likely tokens
        # the most likely token stays whatever top_p is (a top_p below float32's smallest
        # number rounds to 0 in this comparison, and its `before`, 0, would reach it)
        keep[1:][before[1:] >= top_p] = 0.0
    pick = torch.multinomial(keep, 1, generator=generator)
    return Sample(token_id=int(order[pick]), top=top)


def _largest(probs: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The `count` largest probabilities and their ids, descending, ties in id order — the
    first `count` entries of a stable descending sort of the whole vector."""
    count = min(count, probs.numel())
    if count == probs.numel():
        return torch.sort(probs, descending=True, stable=True)
    cutoff = probs.topk(count).values[-1]
    ids = (probs >= cutoff).nonzero().squeeze(1)  # every tie at the cut, in id order
    values, order = torch.sort(probs[ids], descending=True, stable=True)
    return values[:count], ids[order[:count]]


def _validate(logits: Tensor, temperature, top_k, top_p, repetition_penalty) -> None:
    if not isinstance(logits, Tensor) or logits.dim() != 1 or logits.numel() == 0:
        raise ValueError("logits must be a non-empty 1-D tensor [vocab]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
