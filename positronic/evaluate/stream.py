"""Teacher forcing a token stream through the real tick machinery: the NLL of each next token
under a bounded cache, and the configs of the runs (a policy at a budget, the full cache).

Each tick's token is forced instead of sampled (`Brain.step(force=token)`); the NLL of the
true next token is read from the state's next-token logits *before* it is added, and then
the tick runs as in a run (the policy plans, its actions and the `add` go through Step 4).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields

import torch

from ..brain.loop import Brain, BrainConfig
from ..policies import DEFAULT_WINDOW, POLICIES


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


@dataclass(frozen=True)
class RunSettings:
    """The cache settings every run of one eval shares (its flags; None: the library default).
    `config(policy, budget)` makes each run's BrainConfig, giving a setting that only some
    policies read to those alone, as in a sweep of several: `gates` and `memory_rank` to
    smartkv (and `reread` to smartkv with recall), `evict_every` to the shared-row policies,
    `policy_options` to policies made from a press. Made from keywords by `of`, which names an
    unknown one."""
    sinks: int = 4
    protect: int = 0
    at_capacity: str = "shift"
    score_layers: object = "last"
    repairer: str | None = None
    repair_batch: int | None = None
    evict_every: int = 0  # how often the shared-row policies edit (0: each one's own)
    kv_format: str = "float"
    gates: str = ""  # smartkv's gate file ("": the gates shipped for the model)
    kv_store: str = "splice"
    memory_rank: str | None = None  # smartkv's memory rank (None: recent with recall, else gates)
    reread: bool | None = None  # smartkv with recall: reread after a look (None: the default, on)
    policy_options: str = ""  # "name=value,...": a press's own settings

    @classmethod
    def of(cls, settings: dict) -> RunSettings:
        if unknown := sorted(set(settings) - {f.name for f in fields(cls)}):
            raise TypeError(f"not an eval setting: {', '.join(unknown)} (settings: "
                            f"{', '.join(f.name for f in fields(cls))})")
        return cls(**settings)

    def config(self, policy: str, budget: int, *, recall: bool = False) -> BrainConfig:
        """The BrainConfig of `policy` at `budget`; EvalError if the combination cannot run."""
        known = POLICIES.get(policy)
        smartkv = bool(known and known.per_layer)
        chosen = {"repairer": self.repairer, "repair_batch": self.repair_batch}
        if self.evict_every and takes_evict_every(policy):
            chosen["evict_every"] = self.evict_every
        config = BrainConfig(policy=policy, budget=budget, sinks=self.sinks, protect=self.protect,
                             at_capacity=self.at_capacity, score_layers=self.score_layers, recall=recall,
                             kv_format=self.kv_format, kv_store=self.kv_store, gates=self.gates if smartkv else "",
                             memory_rank=self.memory_rank if smartkv else None,
                             reread=self.reread if smartkv and recall else None,
                             policy_options=self.policy_options if hasattr(known, "press_class") else "",
                             **{k: v for k, v in chosen.items() if v is not None})
        try:
            config.validate()
            POLICIES[policy].check(config)
        except ValueError as exc:  # a press's own setting is refused by the press, in its words: say which flag
            field = getattr(exc, "field", None)
            raise EvalError(f"policy_options: {exc}" if field == "policy_options" else str(exc)) from None
        return config

    def reference(self, length: int) -> BrainConfig:
        """The full-cache reference for streams of up to `length` tokens (`reference_config`)."""
        return reference_config(length, sinks=self.sinks, protect=self.protect, score_layers=self.score_layers,
                                kv_format=self.kv_format)


def make_config(policy: str, budget: int, *, recall: bool = False, **settings) -> BrainConfig:
    """The BrainConfig of one run of `policy` at `budget` with the eval `settings` (RunSettings'
    fields); EvalError if the combination cannot run."""
    return RunSettings.of(settings).config(policy, budget, recall=recall)


def takes_evict_every(policy: str) -> bool:
    """Whether `policy` edits in batches that `evict_every` sets (the shared-row policies but none)."""
    return policy in POLICIES and not POLICIES[policy].per_layer and policy != "none"


def reference_config(length: int, *, sinks: int = 4, protect: int = 0, score_layers="last",
                     kv_format: str = "float") -> BrainConfig:
    """The full-cache reference for streams of up to `length` tokens: policy `none` with a
    budget the stream never reaches (so it never stops and never evicts), and at least what
    BrainConfig.validate asks of any budget (room for the default window, which policy none
    never reads: nothing is culled anyway)."""
    return BrainConfig(policy="none", budget=max(length + 1, max(sinks, protect) + DEFAULT_WINDOW + 4), sinks=sinks,
                       protect=protect, at_capacity="stop", score_layers=score_layers, kv_format=kv_format)


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

