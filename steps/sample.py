"""Step 1: turn the newest next-token logits into one sampled token.

Pure function: the caller owns the generator, so a seeded run is reproducible. The run and
the server both sample here, through transformers' logits processors and warpers.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor
from transformers.generation.logits_process import (LogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopPLogitsWarper)

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

    `top` is the distribution after the penalties, the bias and temperature but before
    top-k / top-p / min-p filtering, so it shows what the model wanted, not what survived.
    """

    token_id: int
    top: list[tuple[int, float]]


def sample(
    logits: Tensor,
    *,
    temperature: float = 0.7,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    recent_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    allowed: Tensor | None = None,
) -> Sample:
    """Sample one token id from `logits` (shape [vocab], any float dtype), through
    transformers' logits processors, in vLLM's order:

    1. the bias, then penalties on the tokens of `recent_ids`:
       - logit_bias {token id: bias} added (transformers' SequenceBiasLogitsProcessor);
       - repetition_penalty (CTRL / transformers' RepetitionPenaltyLogitsProcessor): for each
         distinct id, a positive logit is divided by the penalty, a negative one multiplied;
       - presence_penalty, frequency_penalty (OpenAI's): a logit loses `presence` once if its
         token occurs, and `frequency` per occurrence (OccurrencePenalty);
       - logit_bias {token id: bias} added (transformers' SequenceBiasLogitsProcessor);
    2. temperature <= 1e-3: greedy (argmax of the penalised logits, ties to the lowest id);
       else divided by the temperature (TemperatureLogitsWarper);
    3. top_k (0 = off; the k most likely, ties at the cut kept, as transformers' TopKLogitsWarper
       keeps them), then top_p (1.0 = off), then min_p (0 = off: a token is kept if its
       probability is at least min_p times the most likely one's): transformers' warpers on
       the top_k survivors, each keeping at least the most likely token, so the set is never empty.

    generator: a CPU `torch.Generator`; the same seed gives the same token.
    allowed: [vocab] bool, the only tokens that may be drawn (a grammar's mask,
    positronic/brain/grammar.py): the others' logits are -inf before step 1, so the record's
    top candidates and every filter see the allowed ones only.

    Raises NonFiniteLogits if `logits` hold NaN or +inf or nothing finite (before drawing: the
    generator is untouched), ValueError for bad arguments.
    """
    _validate(logits, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty)
    # One small vector per tick: float32 on the CPU avoids float16 overflow/rounding in
    # softmax and lets a CPU generator drive the draw whatever device the model is on.
    # (no copy: every step below makes a new tensor, so the caller's logits are never written)
    x = logits.detach().to("cpu", torch.float32)[None]  # [1, vocab]: the processors take a batch
    vocab = x.shape[-1]
    top_logit = x.max()  # NaN if any is NaN
    if not bool(torch.isfinite(top_logit)):
        raise NonFiniteLogits(f"the logits hold {'NaN' if bool(x.isnan().any()) else 'inf or no finite value'}: "
                              f"their largest is {float(top_logit)}")
    if allowed is not None:
        if allowed.shape != (vocab,) or allowed.dtype != torch.bool or not bool(allowed.any()):
            raise ValueError(f"allowed must be a [{vocab}] bool tensor with a token allowed, got "
                             f"{tuple(allowed.shape)} {allowed.dtype}")
        x = x.masked_fill(~allowed.to(x.device), -math.inf)
    recent = torch.tensor([int(i) for i in recent_ids], dtype=torch.long)[None]  # [1, n]
    if recent.numel() and (int(recent.min()) < 0 or int(recent.max()) >= vocab):
        raise ValueError(f"recent_ids must lie in [0, {vocab}), got {sorted(set(recent[0].tolist()))}")
    x = _penalised(x, recent, repetition_penalty, presence_penalty, frequency_penalty, logit_bias or {})
    x = x - x.max()  # the largest is 0: no temperature can overflow it, and softmax is exact at the top

    greedy = temperature <= GREEDY_BELOW
    tempered = x if greedy else TemperatureLogitsWarper(float(min(temperature, TEMPERATURE_CAP)))(recent, x)
    probs = torch.softmax(tempered[0], dim=-1)
    cut = top_k if not greedy and top_k and top_k < vocab else 0
    # with top_k, the largest logits once for it and for the record (a topk over a 49k vocabulary is
    # ~0.1 ms on a CPU, a fifth of a draw): softmax keeps their order, so they are the largest probabilities
    ranked = tempered[0].topk(min(max(TOP_N, cut) + 1, vocab)) if cut else None
    # Only the candidates that can matter are sorted (a full sort of a 50k vocabulary is
    # ~5 ms, a tenth of a decode step): the top 20 for the record.
    sorted_probs, order = _largest(probs, TOP_N, ranked)
    top = list(zip(order.tolist(), sorted_probs.tolist()))  # two conversions, not one per element
    if greedy:
        # argmax on the logits, not the probabilities: softmax can round distinct
        # large logits to the same probability.
        return Sample(token_id=int(torch.argmax(x[0])), top=top)
    candidates = None  # every token
    if cut:
        # TopKLogitsWarper's set (ties at the cut kept), taken first: top_p and min_p then sort and
        # filter these few, not the whole vocabulary (a 49k sort is ~5 ms, a tenth of a CPU tick)
        values, ids = ranked
        if values[cut] < values[cut - 1]:  # no tie at the cut: the k largest, in id order (as below)
            candidates = ids[:cut].sort().values
        else:
            candidates = (tempered[0] >= values[cut - 1]).nonzero().squeeze(1)
        tempered = tempered[:, candidates]
    if top_p < 1.0:
        tempered = TopPLogitsWarper(float(top_p))(recent, tempered)
    if min_p > 0.0:
        tempered = MinPLogitsWarper(float(min_p))(recent, tempered)
    kept = torch.softmax(tempered[0], dim=-1)
    pick = int(torch.multinomial(kept, 1, generator=generator))
    return Sample(token_id=pick if candidates is None else int(candidates[pick]), top=top)


class OccurrencePenalty(LogitsProcessor):
    """OpenAI's presence and frequency penalties: a token's logit loses `presence` if it occurs
    in `input_ids` and `frequency` for each time it does (transformers has no such processor)."""

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids, torch.ones_like(input_ids, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@functools.lru_cache(maxsize=64)
def _bias(pairs: tuple[tuple[int, float], ...]) -> SequenceBiasLogitsProcessor:
    """One processor per bias (it builds a [vocab] tensor on its first call): a run or a
    session keeps its bias, so the tensor is built once."""
    # the dict form: transformers < 5.18 refuses token id 0 in the list form ("positive integers")
    return SequenceBiasLogitsProcessor({(token,): bias for token, bias in pairs})


def _penalised(x: Tensor, recent: Tensor, repetition: float, presence: float, frequency: float,
               logit_bias: Mapping[int, float]) -> Tensor:
    """Step 1's penalties and bias on x [1, vocab]. A bias id outside the vocabulary is a
    ValueError. Penalties so extreme that they leave no finite logit are not applied (a
    token must remain drawable); one beyond float32 leaves the largest float32, not inf."""
    processors: list[LogitsProcessor] = []
    if logit_bias:  # first, as in vLLM: a penalty weighs against a favoured token too
        if bad := [t for t in logit_bias if not 0 <= t < x.shape[-1]]:
            raise ValueError(f"logit_bias token ids must lie in [0, {x.shape[-1]}), got {sorted(bad)}")
        processors.append(_bias(tuple(sorted((int(t), float(b)) for t, b in logit_bias.items()))))
    if recent.numel() and repetition != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(float(repetition)))
    if recent.numel() and (presence or frequency):
        processors.append(OccurrencePenalty(presence, frequency))
    if not processors:
        return x
    out = x.clone()
    for processor in processors:  # called directly: LogitsProcessorList inspects each signature per call
        out = processor(recent, out)
    largest = float(out.max())  # NaN if any is NaN
    if math.isnan(largest) or largest == math.inf:  # an extreme penalty met a 0 or a huge logit
        out = out.nan_to_num(nan=0.0, posinf=torch.finfo(torch.float32).max, neginf=-math.inf)
        largest = float(out.max())
    return out if math.isfinite(largest) else x


def _largest(probs: Tensor, count: int, ranked: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The `count` largest probabilities and their ids, descending, ties in id order — the
    first `count` entries of a stable descending sort of the whole vector. `ranked`: the
    topk (more than `count`) of values that `probs` grows with (their logits), if at hand."""
    count = min(count, probs.numel())
    if count == probs.numel():
        return torch.sort(probs, descending=True, stable=True)
    if ranked is not None and len(ranked[1]) > count:
        ids = ranked[1][: count + 1]  # every other id's logit is at most the last one's (its probability: checked below)
        values = probs[ids]
    else:
        values, ids = probs.topk(count + 1)  # descending; equal values in no set order
    # no two alike, at the cut or above it: the stable sort's first `count` (a tick's usual case, ~0.1 ms
    # less); from `ranked`, only if no other probability passes the last (a vectorised exp need not
    # keep the order of logits a rounding apart)
    if not bool((values[1:] == values[:-1]).any()) and (ranked is None or int((probs > values[count]).sum()) == count):
        return values[:count], ids[:count]
    cutoff = values[count - 1]
    ids = (probs >= cutoff).nonzero().squeeze(1)  # every tie at the cut, in id order
    values, order = torch.sort(probs[ids], descending=True, stable=True)
    return values[:count], ids[order[:count]]


def _validate(logits: Tensor, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
              frequency_penalty) -> None:
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
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")


def sample_many(logits: Tensor, recent: Tensor, settings: Sequence[tuple[float, int, float, float, float]],
                generators: Sequence[torch.Generator]) -> list[int]:
    """Step 1 of S sampling sequences at once: row s's token is `sample(logits[s],
    temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r, recent_ids=...,
    generator=generators[s])`'s for `settings[s]` = (t, k, p, m, r), to the bit and with the
    same draw from its generator. The penalties, temperature, top-k, top-p and min-p run over
    every row of one setting at once (the same row-wise operations `sample` runs on one row);
    only the draw is a call per row, each from its own generator. Rows without a bias or
    presence / frequency penalties only (`sample` takes those). `recent` [S, window] as in
    `greedy_many`. A row whose top-k cut falls inside a tie, or whose penalties leave a
    non-finite logit, is drawn by `sample` itself. NonFiniteLogits as `greedy_many`."""
    x = logits.detach().to(torch.float32, copy=True)
    _check_finite(x)
    vocab = x.shape[-1]
    x = _repetition(x, recent, [setting[4] for setting in settings])
    tokens: list[int | None] = [None] * len(settings)
    groups: dict[tuple, list[int]] = {}
    for row, setting in enumerate(settings):
        groups.setdefault(tuple(setting[:4]), []).append(row)
    for (temperature, top_k, top_p, min_p), rows in groups.items():
        if temperature <= GREEDY_BELOW:
            raise ValueError("sample_many draws: greedy rows go to greedy_many")
        part = x[rows]
        finite = torch.isfinite(part.amax(dim=-1))  # an extreme penalty: `sample` mends it
        part = part - part.amax(dim=-1, keepdim=True)
        tempered = TemperatureLogitsWarper(float(min(temperature, TEMPERATURE_CAP)))(recent, part)
        candidates, exact = None, finite
        if top_k and top_k < vocab:
            values, ids = tempered.topk(min(max(TOP_N, top_k) + 1, vocab))
            exact = exact & (values[:, top_k] < values[:, top_k - 1])  # a tie at the cut: `sample`'s own rule
            candidates = ids[:, :top_k].sort(dim=1).values
            tempered = tempered.gather(1, candidates)
        if top_p < 1.0:
            tempered = TopPLogitsWarper(float(top_p))(recent, tempered)
        if min_p > 0.0:
            tempered = MinPLogitsWarper(float(min_p))(recent, tempered)
        kept = torch.softmax(tempered, dim=-1)
        drawn = [k for k, ok in enumerate(exact.tolist()) if ok]
        if drawn:  # one draw a row from its own generator; the rest once for all of them
            picks = torch.cat([torch.multinomial(kept[k], 1, generator=generators[rows[k]]) for k in drawn])
            if candidates is not None:
                picks = candidates[drawn, picks]
            for k, pick in zip(drawn, picks.tolist()):
                tokens[rows[k]] = pick
    for row, token in enumerate(tokens):
        if token is None:
            temperature, top_k, top_p, min_p, penalty = settings[row]
            ids = dict.fromkeys(recent[row].tolist()) if recent.numel() else ()  # `sample` penalises each id once
            tokens[row] = sample(logits[row], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                 repetition_penalty=penalty, recent_ids=list(ids), generator=generators[row]).token_id
    return tokens


def _repetition(x: Tensor, recent: Tensor, penalties: Sequence[float]) -> Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor on each row of x [S, vocab] (in place)
    with its own penalty (a Python float, as `sample` passes it) over its ids `recent` [S, n]."""
    values = sorted(set(penalties) - {1.0})
    if not recent.numel() or not values:
        return x
    score = x.gather(1, recent)  # [S, n]
    penalised = score
    for value in values:  # rows of each penalty by a mask, not an index: no wait on the device
        changed = torch.where(score < 0, score * value, score / value)
        if len(set(penalties)) == 1:  # one penalty for every row (the usual case): no mask at all
            penalised = changed
        else:
            rows = torch.tensor([penalty == value for penalty in penalties], device=x.device)[:, None]
            penalised = torch.where(rows, changed, penalised)
    return x.scatter_(1, recent, penalised)


def _check_finite(logits: Tensor) -> None:
    """NonFiniteLogits naming the rows of `logits` [S, vocab] that hold NaN or +inf or nothing
    finite (one wait on the device when all are finite)."""
    top = logits.amax(dim=-1)  # amax: max's values without its indices, 4x faster on [32, 49152]
    if not bool(torch.isfinite(top).all()):
        bad = (~torch.isfinite(top)).nonzero().flatten().tolist()
        raise NonFiniteLogits(f"the logits of rows {bad} hold NaN or inf or no finite value")


def greedy_many(logits: Tensor, recent: Tensor, penalties: Sequence[float], *, finite: bool = False) -> list[int]:
    """Step 1 of S greedy sequences at once: the argmax of each row of `logits` [S, vocab]
    after its repetition penalty over its recent ids `recent` [S, window] (a row shorter than
    the window repeats one of its own ids: a repeated id is penalised once either way).
    Each row's token is `sample(logits[s], temperature=0, repetition_penalty=penalties[s],
    recent_ids=...)`'s, to the bit: the same gather, where and scatter as transformers'
    RepetitionPenaltyLogitsProcessor, sequences of one penalty together (a Python float, as
    `sample` passes it). NonFiniteLogits names the rows that hold NaN or +inf or nothing finite;
    `finite`: the caller has just checked every row (on a GPU the check is a wait of its own)."""
    if not finite:
        _check_finite(logits)
    return greedy_tensor(logits, recent, penalties).tolist()


def greedy_tensor(logits: Tensor, recent: Tensor, penalties: Sequence[float]) -> Tensor:
    """`greedy_many`'s tokens [S] int64 on the logits' device, unread (no wait), from logits the
    caller knows are finite."""
    x = logits.detach().to(torch.float32, copy=True)  # the caller's logits are never written
    return _repetition(x, recent, penalties).argmax(dim=-1)
