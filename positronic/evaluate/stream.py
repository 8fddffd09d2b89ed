"""Teacher forcing a token stream through the real tick machinery: the NLL of each next token
under a bounded cache, and the configs of the runs (a policy at a budget, the full cache).

Each tick's token is forced instead of sampled (`Brain.step(force=token)`); the NLL of the
true next token is read from the state's next-token logits *before* it is added, and then
the tick runs as in a run (the policy plans, its actions and the `add` go through Step 4).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..brain.loop import Brain, BrainConfig
from ..policies import POLICIES


class EvalError(ValueError):
    """A bad evaluation setting (printed as one line by the CLI, exit code 2)."""



@dataclass
class StreamResult:
    nll: list[float]
    ranks: list[int]  # ranks of the tokens at index >= rank_from
    stopped_at: int | None
    deletes: int
    repairs: int
    max_live: int
    rebuilds: int
    seconds: float


def make_config(policy: str, budget: int, *, sinks: int = 4, protect: int = 0, at_capacity: str = "shift",
                score_layers="last", repairer: str | None = None, repair_batch: int | None = None, evict_every: int = 0,
                recall: bool = False, kv_format: str = "float", gates: str = "", kv_store: str = "splice",
                memory_rank: str | None = None) -> BrainConfig:
    """The BrainConfig of one run (None: the library default); EvalError if the combination cannot run.
    `evict_every`: how often the shared-row policies edit (0: each one's own; the others keep theirs).
    `gates`: policy smartkv's gate file ("" = the gates shipped for the model); `memory_rank`: its
    memory's rank (gates | recent; None: the run's default, recent with recall)."""
    chosen = {"repairer": repairer, "repair_batch": repair_batch}
    if evict_every and takes_evict_every(policy):  # as --gates: the policies that take it, in a sweep of several
        chosen["evict_every"] = evict_every
    config = BrainConfig(policy=policy, budget=budget, sinks=sinks, protect=protect, at_capacity=at_capacity,
                         score_layers=score_layers, recall=recall, kv_format=kv_format, kv_store=kv_store,
                         gates=gates if (policy in POLICIES and POLICIES[policy].per_layer) else "",  # smartkv's only
                         memory_rank=memory_rank if (policy in POLICIES and POLICIES[policy].per_layer) else None,
                         **{k: v for k, v in chosen.items() if v is not None})
    try:
        config.validate()
        POLICIES[policy].check(config)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    return config


def takes_evict_every(policy: str) -> bool:
    """Whether `policy` edits in batches that `evict_every` sets (the shared-row policies but none)."""
    return policy in POLICIES and not POLICIES[policy].per_layer and policy != "none"


def reference_config(length: int, *, sinks: int = 4, protect: int = 0, score_layers="last",
                     kv_format: str = "float") -> BrainConfig:
    """The full-cache reference for streams of up to `length` tokens: policy `none` with a
    budget the stream never reaches (so it never stops and never evicts), and at least what
    BrainConfig.validate asks of any budget (no recent window: nothing is culled anyway)."""
    return BrainConfig(policy="none", budget=max(length + 1, max(sinks, protect) + 4), sinks=sinks, protect=protect,
                       window=0, at_capacity="stop", score_layers=score_layers, kv_format=kv_format)


@torch.inference_mode()
def run_stream(lm, ids: list[int], config: BrainConfig, *, rank_from: int | None = None,
               on_token=None) -> StreamResult:
    """Teacher-force `ids` (ids[0] is the start, usually BOS) through a Brain kept by
    `config.policy`: the same tick loop as a run, with each tick's token forced instead of
    sampled. nll[i] is the NLL of ids[i + 1]. `on_token(i)` is called per step."""
    if len(ids) < 2:
        raise EvalError("the stream needs at least two tokens")
    start = time.perf_counter()
    brain = Brain.start(lm, ids[:1], config)
    nll: list[float] = []
    ranks: list[int] = []
    max_live = len(brain.state)
    stopped_at = None
    for i in range(1, len(ids)):
        target = ids[i]
        logprobs = torch.log_softmax(brain.state.next_logits.float(), dim=-1)
        nll.append(-float(logprobs[target]))
        if rank_from is not None and i >= rank_from:
            ranks.append(int((logprobs > logprobs[target]).sum()) + 1)
        if on_token:
            on_token(i)
        if i == len(ids) - 1:
            break
        record = brain.step(force=target)
        if record.rebuilt:  # a failed tick added nothing: feed the same token again
            record = brain.step(force=target)
            if record.rebuilt:
                raise RuntimeError(f"tick {brain.tick} failed twice (stream index {i}): {record.error}")
        max_live = max(max_live, record.live_length)
        if record.stopped:
            stopped_at = i
            break
    counts = brain.counts
    return StreamResult(nll, ranks, stopped_at, counts["culls"], counts["repairs"], max_live,
                        counts["rebuilds"], time.perf_counter() - start)


def perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll)) if nll else float("nan")


def segment_bounds(count: int, segments: int) -> list[tuple[int, int]]:
    """`segments` consecutive [start, stop) chunks of `count` scored tokens (as equal as possible)."""
    segments = max(1, min(segments, count))
    return [(count * k // segments, count * (k + 1) // segments) for k in range(segments)]

