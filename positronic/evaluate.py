"""How much a bounded cache costs: perplexity of a long text per policy and budget.

    positronic eval --budget 128 --budget 256 --max-tokens 1024 --out bench/eval_results
    python run.py eval --policy h2o --policy streaming --budget 64 --text my.txt

    from positronic.evaluate import evaluate, write_outputs
    report = evaluate(lm, text, policies=["streaming", "h2o"], budgets=[128], max_tokens=512)
    report.runs[0].ppl, report.runs[0].ratio, report.runs[0].probe.recalled

Teacher forcing through the real tick machinery: the text is tokenized (BOS first) and fed
one token per tick through a `Brain` (the same loop as a run), each tick's token forced
instead of sampled (`Brain.step(force=token)`). At each tick the NLL of the true next token
is read from the state's next-token logits (log-softmax) *before* it is added; then the tick
runs as it would in a run: the policy plans from the newest token's attention, and its
actions plus the `add` of the true token go through Step 4. So every policy sees, edits and
is scored on the same cache the generator would have; brightness repairs when a repairer is
set (`--repairer bridge|self`; the default culls). A tick that fails changes nothing, so it is run again with the
same token (a second failure ends the evaluation).

Reported per (policy, budget): perplexity exp(mean NLL) over all predicted tokens and over
`segments` equal consecutive chunks, and the ratio to the full cache over the same tokens.
The full-cache reference is policy `none` with a budget above the stream length (so nothing
is ever evicted); it is run automatically whenever the stream fits the model's positions
(when only the probe fits, it runs the probe alone: its perplexity cells stay empty).
`none` below that budget follows `at_capacity`: `shift` (default here; llama.cpp's context
shift) or `stop` (the run ends when the cache is full; later tokens are not scored and the
coverage column says how many were).

Retrieval probe: BOS, the first k of `probe_filler` text tokens, a fact ("The secret code is
4817. ..."), the rest of the filler, then the question "... Answer: The secret code is " (its
trailing space is one token, as in the fact); the answer "4817" (one token per digit in
SmolLM2 and Llama tokenizers) is teacher-forced. k = round(probe_at * filler): `probe_at` 0
(default) puts the fact first, 1 right before the question. The fact never lands in the rows
no policy evicts (the first max(sinks, protect) rows, BOS included): it is shifted to start
right after them (k raised to max(sinks, protect) - 1), so it survives only if the policy
keeps it; a filler too short for that is refused. The filler is taken from the whole text
(not only the first `max_tokens`); a text shorter than an explicit `probe_filler` is refused
(the default, the largest budget + 128 so that every bounded cache has had to evict, is cut
to the text), and so is a probe stream longer than the model's positions.
Recorded per run: the answer's NLL in nats (sum over its tokens), the full cache's answer NLL
and the difference `delta` ("Δ nats vs full"; the issue's target: within 1 nat over the
4-digit answer), the rank of each answer token under the next-token distribution, and
`recalled` = every answer token ranked first (greedy decoding would reproduce the code).

`kv_format` (`eval --kv-format int4|fp4`) stores every run's cache rows, the full cache's
included, in that 4-bit format (positronic/kv_formats.py); the table's title and the settings
give the format and its cache bytes per token. Compare two evals to see what the format costs.

`recall=True` (`eval --recall`) runs every bounded policy (all but `none`) a second time
with BrainConfig.recall on, labelled e.g. "brightness+recall", next to the run without.

Outputs (`write_outputs`): results.csv (one row per run), results.json (settings, every run
with its per-token NLL), nll_by_position.png (moving-average NLL over position, one subplot
per budget, one line per policy, the full cache dashed).
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import kv_formats
from .loop import Brain, BrainConfig
from .policy import POLICIES
from .texts import DEFAULT_TEXT  # texts/alice_ch1-2.txt, shipped as package data

DEFAULT_POLICIES = ("brightness", "streaming", "scored", "h2o", "none")
DEFAULT_BUDGETS = (128, 256, 512)
PROBE_FACT = "The secret code is 4817. Remember this code.\n\n"
PROBE_QUESTION = "\n\nQuestion: what is the secret code? Answer: The secret code is "
PROBE_ANSWER = "4817"  # the space before it belongs to the question: only the digits are scored


class EvalError(ValueError):
    """A bad evaluation setting (printed as one line by the CLI, exit code 2)."""


@dataclass
class ProbeResult:
    logprob: float  # sum of the answer tokens' log-probabilities (natural log)
    ranks: list[int]  # rank of each answer token (1 = most likely)
    filler: int  # filler tokens in the stream (before and after the fact)
    logprobs: list[float] = field(default_factory=list)  # per answer token
    recalled: bool = False  # every answer token ranked first
    fact_at: int = 1  # stream index of the fact's first token (its row until something is evicted)
    nll: float = 0.0  # the answer's NLL in nats: -logprob
    full_nll: float | None = None  # the full cache's answer NLL on the same stream
    delta: float | None = None  # nll - full_nll ("Δ nats vs full")

    def __post_init__(self):
        self.recalled = bool(self.ranks) and all(r == 1 for r in self.ranks)
        self.nll = -self.logprob

    def compare(self, full: ProbeResult | None) -> None:
        """Record the full cache's answer NLL and the difference to it."""
        if full is not None:
            self.full_nll, self.delta = full.nll, self.nll - full.nll


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
                score_layers="last", repairer: str | None = None, repair_batch: int | None = None,
                recall: bool = False, kv_format: str = "float") -> BrainConfig:
    """The BrainConfig of one run (None: the library default); EvalError if the combination cannot run."""
    chosen = {"repairer": repairer, "repair_batch": repair_batch}
    config = BrainConfig(policy=policy, budget=budget, sinks=sinks, protect=protect, at_capacity=at_capacity,
                         score_layers=score_layers, recall=recall, kv_format=kv_format,
                         **{k: v for k, v in chosen.items() if v is not None})
    try:
        config.validate()
        POLICIES[policy].check(config)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    return config


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


@dataclass
class ProbeStream:
    ids: list[int]  # BOS, filler[:k], fact, filler[k:], question, answer
    fact_at: int  # stream index of the fact's first token
    fact_end: int  # one past its last
    answer_at: int  # stream index of the first answer token
    filler: int


def probe_stream(lm, text_ids: list[int], filler: int, at: float = 0.0, keep: int = 1) -> ProbeStream:
    """BOS + the first k of `filler` text tokens + fact + the rest + question + answer, with
    k = round(at * filler) raised so that the fact starts at stream index `keep` or later
    (keep = max(sinks, protect): rows no policy evicts). The answer's tokens are those the
    tokenizer gives the question and answer together. EvalError, before anything runs, for a
    filler that is negative, longer than the text or too short to clear `keep`, and for a
    stream longer than the model's positions."""
    if not 0.0 <= at <= 1.0:
        raise EvalError(f"--probe-at must be a fraction in 0..1, got {at}")
    if filler < 0:
        raise EvalError(f"--probe-filler must be >= 0, got {filler}")
    if filler > len(text_ids):
        raise EvalError(f"--probe-filler {filler} is longer than the text ({len(text_ids)} tokens): "
                        "give a longer --text or a smaller --probe-filler")
    before = max(round(at * filler), keep - 1)
    if before > filler:
        raise EvalError(f"the probe's fact would land in the first {keep} rows, which are never evicted "
                        f"(sinks/protect): --probe-filler must be at least {keep - 1}, got {filler}")
    fact = lm.encode(PROBE_FACT)
    question, joint = lm.encode(PROBE_QUESTION), lm.encode(PROBE_QUESTION + PROBE_ANSWER)
    answer = joint[len(question):] if joint[:len(question)] == question else lm.encode(PROBE_ANSWER)
    fixed = 1 + len(fact) + len(question) + len(answer)
    if fixed + filler > lm.max_positions:
        raise EvalError(f"the probe stream ({fixed + filler} tokens: {filler} of filler + {fixed} of BOS, fact, "
                        f"question and answer) is above {lm.name}'s {lm.max_positions} positions: "
                        f"--probe-filler can be at most {lm.max_positions - fixed}")
    head = [lm.bos_id] + text_ids[:before] + fact + text_ids[before:filler] + question
    return ProbeStream(head + answer, 1 + before, 1 + before + len(fact), len(head), filler)


def run_probe(lm, probe: ProbeStream, config: BrainConfig, *, on_token=None) -> tuple[ProbeResult | None, StreamResult]:
    """Teacher-force the probe stream through `config`: its ProbeResult (None when the run
    stopped before the answer, `none` with at_capacity stop) and the StreamResult."""
    result = run_stream(lm, probe.ids, config, rank_from=probe.answer_at, on_token=on_token)
    if result.stopped_at is not None:
        return None, result
    answer = result.nll[probe.answer_at - 1:]
    return ProbeResult(-sum(answer), result.ranks, probe.filler, [-x for x in answer], fact_at=probe.fact_at), result


def evaluate(lm, text: str, *, policies=DEFAULT_POLICIES, budgets=DEFAULT_BUDGETS, max_tokens: int = 1024,
             segments: int = 8, sinks: int = 4, protect: int = 0, at_capacity: str = "shift",
             probe: bool = True, probe_filler: int | None = None, score_layers="last", reference: bool = True,
             repairer: str | None = None, repair_batch: int | None = None, probe_at: float = 0.0,
             recall: bool = False, kv_format: str = "float", progress=None, on_run=None,
             text_name: str = "") -> EvalReport:
    """Run every (policy, budget) over the first `max_tokens` tokens of `text`, plus the
    full-cache reference when it fits. `repairer`, `repair_batch`: the brightness policy's
    (None: the library default). `probe_at`: where the probe's fact goes (the fraction of the
    filler before it). `recall`: every policy but `none` also runs with recall on.
    `kv_format`: how every run, the reference included, stores its cache rows.
    `progress` is a rich Progress (or None); `on_run` is called with each finished RunSummary."""
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
    variants = [(p, r) for p in policies for r in ((False, True) if recall and p != "none" else (False,))]
    configs = {(p, r, b): make_config(p, b, sinks=sinks, protect=protect, at_capacity=at_capacity,
                                      score_layers=score_layers, repairer=repairer, repair_batch=repair_batch,
                                      recall=r, kv_format=kv_format)
               for b in budgets for p, r in variants}
    text_ids = lm.encode(text)
    if len(text_ids) < 2:
        raise EvalError("the text has fewer than 2 tokens")
    ids = [lm.bos_id] + text_ids[:max_tokens]
    if max(budgets) > lm.max_positions:
        raise EvalError(f"budget {max(budgets)} is above {lm.name}'s {lm.max_positions} positions")
    filler = probe_filler if probe_filler is not None else min(max(budgets) + 128, len(text_ids))
    pstream = probe_stream(lm, text_ids, filler, probe_at, keep=max(sinks, protect, 1)) if probe else None
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
        ref = one("none", None, reference_config(longest if fits else len(p_ids), sinks=sinks, protect=protect,
                                                 score_layers=score_layers, kv_format=kv_format), scored=fits)
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
    settings = dict(policies=policies, budgets=budgets, max_tokens=max_tokens, segments=segments, sinks=sinks,
                    protect=protect, at_capacity=at_capacity, score_layers=score_layers, repairer=repairer, repair_batch=repair_batch, probe=probe,
                    probe_filler=filler if probe else None, probe_at=probe_at if probe else None,
                    probe_fact_at=pstream.fact_at if probe else None, recall=recall,
                    probe_fact=PROBE_FACT, probe_question=PROBE_QUESTION,
                    probe_answer=PROBE_ANSWER, kv_format=kv_format,
                    kv_bytes_per_token=kv_formats.bytes_per_token(kv_format, layers=lm.num_layers,
                                                                  kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                                                                  dtype=lm.dtype),
                    torch=torch.__version__, dtype=str(lm.dtype).removeprefix("torch."),
                    device=str(lm.device), threads=torch.get_num_threads())
    return EvalReport(lm.name, text_name, len(ids), settings, runs, ref)


# --- output ---------------------------------------------------------------------------------


def fmt_number(value, digits=2) -> str:
    """`value` with `digits` decimals; "-" for a missing or NaN value (a table cell)."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def table(report: EvalReport):
    """A rich Table of the report: one row per run, the reference first."""
    from rich.table import Table

    runs = ([report.reference] if report.reference else []) + report.runs
    nseg = len(runs[0].segments) if runs else 0
    kv = report.settings.get("kv_format", "float")
    t = Table(title=f"{report.model} · {report.text or 'text'} · {report.stream_tokens - 1} tokens · kv {kv} "
                    f"({report.settings.get('kv_bytes_per_token', '?')} B/token) "
                    f"(perplexity; ×full = ratio to the full cache; probe: answer NLL in nats, Δ = minus the full cache's)")
    for name in ("policy", "budget", "ppl", "×full", *[f"s{k + 1}" for k in range(nseg)], "answer NLL",
                 "Δ nats vs full", "ranks", "recalled", "evicted", "repairs", "max live", "ms/tok"):
        t.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True)
    for run in runs:
        probe = run.probe
        scored = run.tokens + (probe.filler if probe else 0)
        t.add_row(run.name, "full" if run.budget is None else str(run.budget), fmt_number(run.ppl), fmt_number(run.ratio, 3),
                  *[fmt_number(s, 1) for s in run.segments], *probe_cells(probe), str(run.deletes + 2 * run.repairs),
                  str(run.repairs), str(run.max_live), f"{1000 * run.seconds / max(scored, 1):.0f}")
    return t


def probe_cells(probe: ProbeResult | None) -> list[str]:
    """answer NLL, Δ nats vs full, ranks, recalled: the probe's table cells ("-" without one)."""
    if probe is None:
        return ["-"] * 4
    delta = "-" if probe.delta is None else f"{probe.delta:+.2f}"
    return [fmt_number(probe.nll), delta, " ".join(map(str, probe.ranks)), "yes" if probe.recalled else "no"]


def write_outputs(report: EvalReport, out: Path, *, smooth: int | None = None) -> dict[str, Path]:
    """Write results.csv, results.json and nll_by_position.png into `out` (created)."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create --out {out}: {exc.strerror or exc}") from None
    runs = ([report.reference] if report.reference else []) + report.runs
    paths = {"csv": out / "results.csv", "json": out / "results.json", "png": out / "nll_by_position.png"}
    nseg = len(runs[0].segments)
    with open(paths["csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["policy", "budget", "recall", "tokens", "ppl", "ratio_to_full",
                         *[f"seg{k + 1}_ppl" for k in range(nseg)], *[f"seg{k + 1}_ratio" for k in range(nseg)],
                         "probe_nll", "probe_full_nll", "probe_delta_nats", "probe_logprob", "probe_ranks",
                         "probe_recalled", "probe_filler", "probe_fact_at", "evicted_rows", "deletes", "repairs",
                         "max_live", "stopped_at", "rebuilds", "seconds"])
        for run in runs:
            probe = run.probe
            cells = ([fmt_number(probe.nll, 4), fmt_number(probe.full_nll, 4), fmt_number(probe.delta, 4),
                      fmt_number(probe.logprob, 4), " ".join(map(str, probe.ranks)), probe.recalled, probe.filler,
                      probe.fact_at] if probe else [""] * 8)
            writer.writerow([run.name, "full" if run.budget is None else run.budget, run.recall, run.tokens,
                             fmt_number(run.ppl, 4), fmt_number(run.ratio, 4), *[fmt_number(s, 4) for s in run.segments],
                             *[fmt_number(s, 4) for s in (run.segment_ratios or [None] * nseg)], *cells,
                             run.deletes + 2 * run.repairs, run.deletes, run.repairs, run.max_live,
                             "" if run.stopped_at is None else run.stopped_at, run.rebuilds, f"{run.seconds:.1f}"])
    data = {"model": report.model, "text": report.text, "stream_tokens": report.stream_tokens,
            "settings": report.settings,
            "reference": _run_json(report.reference) if report.reference else None,
            "runs": [_run_json(run) for run in report.runs]}
    paths["json"].write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    plot(report, paths["png"], smooth=smooth)
    return paths


def _run_json(run: RunSummary) -> dict:
    data = asdict(run)
    data["nll"] = [round(x, 4) for x in run.nll]
    data["label"], data["name"] = run.label, run.name
    return data


def moving_average(values: list[float], window: int) -> tuple[list[int], list[float]]:
    """Trailing moving average: (x, y) with y[k] = mean(values[x-window+1 .. x])."""
    window = max(1, min(window, len(values)))
    total, xs, ys = 0.0, [], []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            xs.append(i + 1)
            ys.append(total / window)
    return xs, ys


def plot(report: EvalReport, path: Path, *, smooth: int | None = None) -> None:
    """NLL over position (moving average), one subplot per budget, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = list(dict.fromkeys(run.budget for run in report.runs))
    window = smooth or max(8, (report.stream_tokens - 1) // 16)
    fig, axes = plt.subplots(len(budgets), 1, figsize=(10, 3.2 * len(budgets)), sharex=True, squeeze=False)
    colors = {"brightness": "tab:orange", "streaming": "tab:blue", "scored": "tab:green", "h2o": "tab:red",
              "none": "tab:purple"}
    for ax, budget in zip(axes[:, 0], budgets):
        if report.reference and report.reference.nll:
            ax.plot(*moving_average(report.reference.nll, window), color="black", linestyle="--", linewidth=1.2,
                    label=f"full cache (ppl {report.reference.ppl:.2f})")
        for run in report.runs:
            if run.budget == budget and run.nll:
                ax.plot(*moving_average(run.nll, window), color=colors.get(run.policy), linewidth=1.1,
                        linestyle="-." if run.recall else "-", label=f"{run.name} (ppl {run.ppl:.2f})")
        ax.axvline(budget, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"budget {budget}", fontsize=10)
        ax.set_ylabel(f"NLL (mean of {window})")
        ax.legend(fontsize=8, loc="upper right", ncol=2)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("token position in the text")
    fig.suptitle(f"{report.model}: next-token NLL over {report.stream_tokens - 1} tokens of {report.text or 'the text'}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- command line ---------------------------------------------------------------------------


def read_text(path: Path | None) -> tuple[str, str]:
    """(text, its display name); OSError/EvalError with one-line messages."""
    path = Path(path) if path is not None else DEFAULT_TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise OSError(f"cannot read --text {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip():
        raise EvalError(f"--text {path} is empty")
    return text, path.name


def progress_bars(console):
    """One bar per run on `console` (stderr). Without a terminal the bars cannot redraw and are
    off: the caller prints one line per finished run instead."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description:>16}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=False, disable=not console.is_terminal)


def table_console():
    """Where result tables go: a terminal at its own width (rich squeezes or wraps the columns
    to fit), a file or pipe 200 columns wide so that no cell is cut."""
    from rich.console import Console

    if sys.stdout.isatty():
        return Console(file=sys.stdout)
    return Console(file=sys.stdout, width=200)


def main(*, model: str = "smollm2", text: Path | None = None, budgets=None, policies=None, max_tokens: int = 1024,
         out: Path = Path("eval_results"), segments: int = 8, sinks: int = 4, protect: int = 0,
         at_capacity: str = "shift", probe: bool = True, probe_filler: int | None = None, device: str | None = None,
         dtype: str | None = None, smooth: int | None = None, repairer: str | None = None,
         repair_batch: int | None = None, probe_at: float = 0.0, recall: bool = False,
         kv_format: str = "float") -> EvalReport:
    """`positronic eval`: check the flags, load the model, run, print the table, write the files."""
    from rich.console import Console

    from .models import load_model

    policies = list(policies or DEFAULT_POLICIES)
    budgets = list(budgets or DEFAULT_BUDGETS)
    for name in policies:
        if name not in POLICIES:
            raise EvalError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    for budget in budgets:
        for name in policies:
            for on in {False, recall and name != "none"}:
                make_config(name, budget, sinks=sinks, protect=protect, at_capacity=at_capacity, repairer=repairer,
                            repair_batch=repair_batch, recall=on, kv_format=kv_format)
    if max_tokens < 2:
        raise EvalError(f"--max-tokens must be >= 2, got {max_tokens}")
    if smooth is not None and smooth < 1:
        raise EvalError(f"--smooth must be >= 1, got {smooth}")
    if probe and not 0.0 <= probe_at <= 1.0:
        raise EvalError(f"--probe-at must be a fraction in 0..1, got {probe_at}")
    if probe and probe_filler is not None and probe_filler < 0:
        raise EvalError(f"--probe-filler must be >= 0, got {probe_filler}")
    body, name = read_text(text)
    lm = load_model(model, device=device, dtype=dtype)
    err = Console(stderr=True)

    def done(run: RunSummary) -> None:  # without a terminal the bars do not redraw: one line per run
        if not err.is_terminal:
            answer = f", answer NLL {run.probe.nll:.2f}" if run.probe else ""
            print(f"{run.label}: ppl {run.ppl:.3f} over {run.tokens} tokens{answer} in {run.seconds:.0f} s",
                  file=sys.stderr, flush=True)

    with progress_bars(err) as progress:
        report = evaluate(lm, body, policies=policies, budgets=budgets, max_tokens=max_tokens, segments=segments,
                          sinks=sinks, protect=protect, at_capacity=at_capacity, probe=probe,
                          probe_filler=probe_filler, repairer=repairer, repair_batch=repair_batch,
                          probe_at=probe_at, recall=recall, kv_format=kv_format, progress=progress, on_run=done,
                          text_name=name)
    table_console().print(table(report))
    paths = write_outputs(report, out, smooth=smooth)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return report
