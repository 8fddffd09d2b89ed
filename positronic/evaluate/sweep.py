"""Every (policy, budget) over one text, plus the full-cache reference: `evaluate` and the
report it returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv import formats as kv_formats
from ..brain.loop import BrainConfig
from ..policies import POLICIES
from .probe import PROBE_ANSWER, PROBE_FACT, PROBE_QUESTION, ProbeResult, probe_stream, run_probe
from .stream import EvalError, RunSettings, perplexity, run_stream, segment_bounds

DEFAULT_POLICIES = ("brightness", "streaming", "scored", "h2o", "none")
DEFAULT_BUDGETS = (128, 256, 512)


@dataclass
class RunSummary:
    policy: str
    budget: int | None  # None: the full-cache reference
    tokens: int  # tokens scored (fewer than the stream when `none` stopped)
    ppl: float
    segments: list[float | None]  # perplexity per segment (None: not reached)
    ratio: float | None = None  # ppl / full-cache ppl over the same tokens
    segment_ratios: list[float | None] = field(default_factory=list)
    probe: ProbeResult | None = None
    deletes: int = 0
    repairs: int = 0
    max_live: int = 0
    stopped_at: int | None = None  # stream index at which `none` (stop) ended the run
    rebuilds: int = 0
    seconds: float = 0.0
    nll: list[float] = field(default_factory=list)  # per scored token, in stream order
    recall: bool = False  # run with BrainConfig.recall on

    @property
    def name(self) -> str:
        """The policy, with "+recall" when recall was on."""
        return self.policy + ("+recall" if self.recall else "")

    @property
    def label(self) -> str:
        return f"{self.name}@{'full' if self.budget is None else self.budget}"


@dataclass
class EvalReport:
    model: str
    text: str
    stream_tokens: int  # BOS + text tokens fed
    settings: dict
    runs: list[RunSummary]
    reference: RunSummary | None



def recallable(policy: str) -> bool:
    """Whether `--recall` adds a POLICY+recall run: not for `none` (it evicts nothing)."""
    return policy != "none"


def evaluate(lm, text: str, *, policies=DEFAULT_POLICIES, budgets=DEFAULT_BUDGETS, max_tokens: int = 1024,
             segments: int = 8, probe: bool = True, probe_filler: int | None = None, reference: bool = True,
             probe_at: float = 0.0, recall: bool = False, recalled: tuple[str, ...] = (), progress=None, on_run=None,
             text_name: str = "", **settings) -> EvalReport:
    """Run every (policy, budget) over the first `max_tokens` tokens of `text`, plus the
    full-cache reference when it fits. `settings`: the runs' cache settings (RunSettings'
    fields: sinks, protect, at_capacity, repairer, kv_format, gates, policy_options, ...; each
    given to the policies that read it). `probe_at`: where the probe's fact goes (the fraction
    of the filler before it). `recall`: every policy that can recall (not `none`) also runs
    with recall on; `recalled`: policies that run with recall on alone (the product's default
    policy, SmartKV with recall, in a sweep of the others without). `kv_format` stores every
    run's rows, the reference's included; `kv_store` is the policies' runs' store (the
    reference keeps the splice store: it never evicts, so a ring would change nothing).
    `progress` is a rich Progress (or None); `on_run` is called with each finished RunSummary."""
    try:
        cache = RunSettings.of(settings)
    except TypeError as exc:
        raise EvalError(str(exc)) from None
    policies, budgets = list(dict.fromkeys(policies)), list(dict.fromkeys(budgets))
    if not policies or not budgets:
        raise EvalError("give at least one policy and one budget")
    for name in policies:
        if name not in POLICIES:
            raise EvalError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    if max_tokens < 2:
        raise EvalError(f"--max-tokens must be >= 2, got {max_tokens}")
    if segments < 1:
        raise EvalError(f"segments must be >= 1, got {segments}")
    variants = [(p, r) for p in policies
                for r in ((False, True) if recall and recallable(p) else (True,) if p in recalled else (False,))]
    configs = {(p, r, b): cache.config(p, b, recall=r) for b in budgets for p, r in variants}
    text_ids = lm.encode(text)
    if len(text_ids) < 2:
        raise EvalError("the text has fewer than 2 tokens")
    ids = [lm.bos_id] + text_ids[:max_tokens]
    if max(budgets) > lm.max_positions:
        raise EvalError(f"budget {max(budgets)} is above {lm.name}'s {lm.max_positions} positions")
    filler = probe_filler if probe_filler is not None else min(max(budgets) + 128, len(text_ids))
    pstream = probe_stream(lm, text_ids, filler, probe_at, keep=max(cache.sinks, cache.protect, 1)) if probe else None
    p_ids = pstream.ids if probe else []
    longest = max(len(ids), len(p_ids))

    def one(policy: str, budget: int | None, config: BrainConfig, *, scored: bool = True) -> RunSummary:
        label = f"{policy}{'+recall' if config.recall else ''}@{'full' if budget is None else budget}"
        total = (len(ids) - 1 if scored else 0) + (len(p_ids) - 1 if probe else 0)
        task = progress.add_task(label, total=total) if progress else None
        tick = (lambda i: progress.advance(task)) if progress else None
        if scored:
            main = run_stream(lm, ids, config, on_token=tick)
            bounds = segment_bounds(len(ids) - 1, segments)
            seg = [perplexity(main.nll[a:b]) if b <= len(main.nll) else None for a, b in bounds]
            summary = RunSummary(policy, budget, len(main.nll), perplexity(main.nll), seg, deletes=main.deletes,
                                 repairs=main.repairs, max_live=main.max_live, stopped_at=main.stopped_at,
                                 rebuilds=main.rebuilds, seconds=main.seconds, nll=main.nll, recall=config.recall)
        else:  # the text does not fit the model's positions: the full cache only answers the probe
            summary = RunSummary(policy, budget, 0, float("nan"), [None] * len(segment_bounds(len(ids) - 1, segments)))
        if probe:
            summary.probe, result = run_probe(lm, pstream, config, on_token=tick)
            summary.seconds += result.seconds
            summary.rebuilds += result.rebuilds
        if progress:
            progress.update(task, completed=progress.tasks[task].total)
        if on_run:
            on_run(summary)
        return summary

    ref = None
    if reference and (longest <= lm.max_positions or probe):  # the full cache fits: nothing is ever evicted
        fits = len(ids) <= lm.max_positions
        ref = one("none", None, cache.reference(longest if fits else len(p_ids)), scored=fits)
    runs = [one(p, b, configs[(p, r, b)]) for b in budgets for p, r in variants]
    if ref is not None and ref.nll:
        bounds = segment_bounds(len(ids) - 1, segments)
        for run in runs:
            run.ratio = run.ppl / perplexity(ref.nll[:run.tokens])
            run.segment_ratios = [None if s is None else s / r for s, r in zip(run.segments, ref.segments)]
        ref.ratio, ref.segment_ratios = 1.0, [1.0] * len(bounds)
    full = ref.probe if ref is not None else None
    for run in ([ref] if ref is not None else []) + runs:
        if run.probe is not None:
            run.probe.compare(full)
    kv_format = cache.kv_format
    settings = dict(policies=policies, budgets=budgets, max_tokens=max_tokens, segments=segments, sinks=cache.sinks,
                    protect=cache.protect, at_capacity=cache.at_capacity, score_layers=cache.score_layers,
                    repairer=cache.repairer, repair_batch=cache.repair_batch, probe=probe,
                    probe_filler=filler if probe else None, probe_at=probe_at if probe else None,
                    probe_fact_at=pstream.fact_at if probe else None, recall=recall,
                    probe_fact=PROBE_FACT, probe_question=PROBE_QUESTION,
                    probe_answer=PROBE_ANSWER, kv_format=kv_format,
                    **({"kv_store": cache.kv_store} if cache.kv_store != "splice" else {}),  # earlier results read as before
                    **({"evict_every": cache.evict_every} if cache.evict_every else {}),
                    **({"policy_options": cache.policy_options} if cache.policy_options else {}),
                    kv_bytes_per_token=kv_formats.bytes_per_token(kv_format, layers=lm.num_layers,
                                                                  kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                                                                  dtype=lm.dtype),
                    torch=torch.__version__, dtype=str(lm.dtype).removeprefix("torch."),
                    **({"weights": lm.weights} if lm.weights != "float32" else {}),
                    device=str(lm.device), threads=torch.get_num_threads())
    return EvalReport(lm.name, text_name, len(ids), settings, runs, ref)

