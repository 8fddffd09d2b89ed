"""What a bounded cache does to what the model writes: free generation per policy and budget.

    positronic eval --generate 256 --budget 128 --policy streaming --policy brightness
    python run.py eval --generate 512 --prompt-tokens 64 --seed 3 --out bench/gen_results

    from positronic.evaluate.generation import evaluate_generation, write_generation_outputs
    report = evaluate_generation(lm, text, policies=["streaming"], budgets=[128], generate=256)
    report.runs[0].ppl, report.runs[0].ratio, report.runs[0].distinct4

Every (policy, budget) generates `generate` tokens from the same prompt (BOS + the first
`prompt_tokens` tokens of the text) with the same sampler seed and the sampling settings of
`BrainConfig` (temperature 0.7, top-k 50, top-p 0.95, repetition penalty 1.1): the real
loop, `Brain.start` then `Brain.step()` once per token, so the policy evicts (and brightness
repairs) exactly as in a run. EOS does not end a run (a run never does). A tick that fails
adds nothing and is run once more; a second failure ends that run (its `error` says why, the
tokens before it are still scored). `none` with `at_capacity` stop ends when the cache is full.
The full-cache reference (policy `none`, a budget above prompt + generate, so nothing is ever
evicted) runs first whenever prompt + generate fits the model's positions.

Reported per run:
- re-scored perplexity: exp(mean NLL) of the generated tokens under the same model with its
  full history (prompt + everything generated before each token, nothing evicted), from one
  plain forward (`rescore`). It asks "is this text what the model itself finds likely", so a
  bounded cache that lost the plot scores worse than the reference; `ratio` is to the
  reference's re-scored perplexity (a different text from the same prompt and seed).
- repetition: distinct-4 = distinct 4-grams / 4-grams of the generated ids (1 = no 4-gram
  repeats; degenerate loops push it toward 0), and the same over whitespace words.
- tokens generated, seconds and tokens/s of the ticks (the prompt's prefill not included),
  the largest live length seen, evictions, repairs, failed ticks.

Outputs (`write_generation_outputs`): generation.csv (one row per run), generation.json
(settings with the prompt and seed; per run its text, ids and per-token re-scored NLL),
texts/<policy>@<budget>.txt (the reference is none@full), side_by_side.md (the prompt, then
every run's text under its own heading).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import (DEFAULT_BUDGETS, DEFAULT_POLICIES, EvalError, RunSettings, fmt_number, perplexity, progress_bars,
               read_text, table_console)
from ..brain.loop import Brain, BrainConfig
from ..models.compat import with_cache

DEFAULT_PROMPT_TOKENS = 128
RESCORE_CHUNK = 512  # query rows per re-scoring forward: bounds the [rows, vocab] logits


@dataclass
class GenerationRun:
    policy: str
    budget: int | None  # None: the full-cache reference
    requested: int  # tokens asked for
    ids: list[int]  # generated token ids, in order (what the sampler drew, not later repairs)
    text: str  # lm.decode(ids)
    seconds: float  # the ticks only, not the prompt's prefill
    max_live: int  # largest live length seen (the prompt's included)
    stopped: bool = False  # the policy said stop (none, at_capacity stop): fewer tokens
    error: str | None = None  # a tick failed twice: the run ended there
    deletes: int = 0
    repairs: int = 0
    rebuilds: int = 0  # failed ticks (each retried once)
    nll: list[float] = field(default_factory=list)  # re-scored NLL per generated token
    ppl: float = float("nan")  # exp(mean(nll))
    ratio: float | None = None  # ppl / the reference's ppl
    distinct4: float | None = None  # over token ids (None: fewer than 4 tokens)
    distinct4_words: float | None = None  # over whitespace words

    @property
    def label(self) -> str:
        return f"{self.policy}@{'full' if self.budget is None else self.budget}"

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class GenerationReport:
    model: str
    text: str  # display name of the text the prompt came from
    prompt_ids: list[int]  # BOS + the prompt's text tokens
    prompt_text: str  # lm.decode(prompt_ids[1:])
    settings: dict
    runs: list[GenerationRun]
    reference: GenerationRun | None
    note: str | None = None  # why there is no reference, if there is none


# --- one run --------------------------------------------------------------------------------


@torch.inference_mode()
def generate_run(lm, prompt_ids: list[int], config: BrainConfig, generate: int, *, on_token=None,
                 reference: bool = False) -> GenerationRun:
    """Generate up to `generate` tokens after `prompt_ids` through a Brain kept by `config`
    (`Brain.start`, then `Brain.step()` per token, sampled with `config`'s settings and seed).
    Returns a GenerationRun with ids/text/timing/live-length filled in (not yet re-scored).
    `reference` labels it the full-cache reference (budget None, shown as `full`). A failed tick
    is run once more; a second failure ends the run with `error` set. `on_token(i)` is called
    after the i-th generated token (1-based)."""
    brain = Brain.start(lm, prompt_ids, config)
    ids: list[int] = []
    max_live, stopped, error = len(brain.state), False, None
    start = time.perf_counter()
    while len(ids) < generate:
        record = brain.step()
        if record.rebuilt:  # a failed tick added nothing: sample again from the same state
            record = brain.step()
            if record.rebuilt:
                error = f"tick {brain.tick} failed twice (after {len(ids)} tokens): {record.error}"
                break
        ids.append(record.token_id)
        max_live = max(max_live, record.live_length)
        if on_token:
            on_token(len(ids))
        if record.stopped:  # the tick's token was added; the policy cannot go on after it
            stopped = True
            break
    seconds = time.perf_counter() - start
    counts = brain.counts
    return GenerationRun(config.policy, None if reference else config.budget, generate, ids, lm.decode(ids),
                         seconds, max_live, stopped=stopped, error=error, deletes=counts["culls"],
                         repairs=counts["repairs"], rebuilds=counts["rebuilds"])


@torch.inference_mode()
def rescore(lm, prompt_ids: list[int], generated_ids: list[int], *, chunk: int = RESCORE_CHUNK) -> list[float]:
    """NLL (natural log) of each generated token given the prompt and every token generated
    before it, from a plain forward of `lm.model` over prompt + generated (positions 0..n-1,
    nothing evicted; chunks of `chunk` rows share a DynamicCache). Returns one float per
    generated token, in order. Positions past lm.max_positions are scored all the same (RoPE
    extrapolates) but are outside what the model was trained on."""
    from transformers import DynamicCache

    if not prompt_ids:
        raise EvalError("re-scoring needs at least one prompt token")
    if not generated_ids:
        return []
    ids = list(prompt_ids) + list(generated_ids)
    first = len(prompt_ids) - 1  # row i's logits predict ids[i + 1]; rows >= first predict generated tokens
    cache, nll = DynamicCache(), []
    for a in range(0, len(ids) - 1, chunk):  # the last token predicts nothing: never fed
        b = min(a + chunk, len(ids) - 1)
        out = lm.model(input_ids=torch.tensor([ids[a:b]], device=lm.device),
                       position_ids=torch.arange(a, b, device=lm.device)[None], **with_cache(cache),
                       use_cache=True)
        lo = max(a, first)
        if lo >= b:  # a chunk of prompt only: it just fills the cache
            continue
        logprobs = torch.log_softmax(out.logits[0, lo - a:].float(), dim=-1)  # [b - lo, vocab]
        targets = torch.tensor(ids[lo + 1:b + 1], device=logprobs.device)
        nll.extend((-logprobs.gather(1, targets[:, None])[:, 0]).tolist())
    return nll


def distinct_n(ids, n: int) -> float | None:
    """Distinct n-grams / all n-grams of the sequence `ids` (any hashable items): 1.0 when no
    n-gram repeats, lower the more the text loops. None when `ids` has fewer than n items."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


# --- the evaluation -------------------------------------------------------------------------


def prompt_of(lm, text: str, prompt_tokens: int) -> list[int]:
    """BOS + the first `prompt_tokens` tokens of `text` (as the teacher-forced stream starts)."""
    text_ids = lm.encode(text)
    if len(text_ids) < prompt_tokens:
        raise EvalError(f"the text has {len(text_ids)} tokens, fewer than --prompt-tokens {prompt_tokens}")
    return [lm.bos_id] + text_ids[:prompt_tokens]


def check_settings(policies, budgets, *, generate: int, prompt_tokens: int,
                   **settings) -> dict[tuple[str, int], BrainConfig]:
    """EvalError for anything that cannot run (before a model is loaded or a file written);
    returns the BrainConfig of every (policy, budget), seed not yet set. `settings`: the runs'
    cache settings (RunSettings' fields)."""
    if not policies or not budgets:
        raise EvalError("give at least one policy and one budget")
    if generate < 1:
        raise EvalError(f"--generate must be >= 1, got {generate}")
    if prompt_tokens < 1:
        raise EvalError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    try:
        cache = RunSettings.of(settings)
    except TypeError as exc:
        raise EvalError(str(exc)) from None
    return {(p, b): cache.config(p, b) for b in budgets for p in policies}


def score_run(lm, prompt_ids: list[int], run: GenerationRun) -> GenerationRun:
    """Fill in the run's re-scored NLL/perplexity and its distinct-4 ratios; returns `run`."""
    run.nll = rescore(lm, prompt_ids, run.ids)
    run.ppl = perplexity(run.nll)
    run.distinct4 = distinct_n(run.ids, 4)
    run.distinct4_words = distinct_n(run.text.split(), 4)
    return run


def evaluate_generation(lm, text: str, *, policies=DEFAULT_POLICIES, budgets=DEFAULT_BUDGETS, generate: int,
                        prompt_tokens: int = DEFAULT_PROMPT_TOKENS, seed: int = 0, reference: bool = True,
                        progress=None, on_run=None, text_name: str = "", **settings) -> GenerationReport:
    """Generate `generate` tokens per (policy, budget) from BOS + the first `prompt_tokens`
    tokens of `text`, all with sampler seed `seed`, plus the full-cache reference when
    prompt + generate fits the model's positions; re-score every run. `settings`: the runs'
    cache settings (RunSettings' fields). Returns a GenerationReport (runs in budget-major
    order, reference separate). `progress` is a rich Progress (or None); `on_run` is called
    with each finished, scored GenerationRun."""
    policies, budgets = list(dict.fromkeys(policies)), list(dict.fromkeys(budgets))
    configs = check_settings(policies, budgets, generate=generate, prompt_tokens=prompt_tokens, **settings)
    cache = RunSettings.of(settings)
    if max(budgets) > lm.max_positions:
        raise EvalError(f"budget {max(budgets)} is above {lm.name}'s {lm.max_positions} positions")
    if prompt_tokens + 1 > lm.max_positions:
        raise EvalError(f"--prompt-tokens {prompt_tokens} (+ BOS) is above {lm.name}'s {lm.max_positions} positions")
    prompt_ids = prompt_of(lm, text, prompt_tokens)
    length = len(prompt_ids) + generate

    def one(config: BrainConfig, full: bool = False) -> GenerationRun:
        config = dataclasses.replace(config, seed=seed)
        label = f"{config.policy}@{'full' if full else config.budget}"
        task = progress.add_task(label, total=generate) if progress else None
        tick = (lambda i: progress.update(task, completed=i)) if progress else None
        run = generate_run(lm, prompt_ids, config, generate, on_token=tick, reference=full)
        score_run(lm, prompt_ids, run)
        if progress:
            progress.update(task, completed=generate)  # a stopped run is done too
        if on_run:
            on_run(run)
        return run

    ref, note = None, None
    if not reference:
        note = "reference not asked for"
    elif length > lm.max_positions:
        note = (f"no full-cache reference: prompt + generated = {length} tokens is above {lm.name}'s "
                f"{lm.max_positions} positions (re-scored perplexities are still computed, beyond them)")
    else:
        ref = one(cache.reference(length), full=True)
    runs = [one(configs[(p, b)]) for b in budgets for p in policies]
    if ref is not None:
        ref.ratio = 1.0
        for run in runs:
            run.ratio = run.ppl / ref.ppl if run.nll else None
    sampling = BrainConfig(seed=seed)
    settings = dict(policies=policies, budgets=budgets, generate=generate, prompt_tokens=prompt_tokens, seed=seed,
                    temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                    repetition_penalty=sampling.repetition_penalty, penalty_window=sampling.penalty_window,
                    sinks=cache.sinks, protect=cache.protect, at_capacity=cache.at_capacity,
                    score_layers=cache.score_layers, repairer=cache.repairer, repair_batch=cache.repair_batch,
                    kv_format=cache.kv_format, **({"evict_every": cache.evict_every} if cache.evict_every else {}),
                    **({"policy_options": cache.policy_options} if cache.policy_options else {}),
                    rescore="full history, plain forward, float32 log_softmax",
                    torch=torch.__version__, dtype=str(lm.dtype).removeprefix("torch."), device=str(lm.device),
                    **({"weights": lm.weights} if lm.weights != "float32" else {}),
                    threads=torch.get_num_threads())
    return GenerationReport(lm.name, text_name, prompt_ids, lm.decode(prompt_ids[1:]), settings, runs, ref, note)


# --- output ---------------------------------------------------------------------------------


def _all_runs(report: GenerationReport) -> list[GenerationRun]:
    return ([report.reference] if report.reference else []) + report.runs


def _tokens_cell(run: GenerationRun) -> str:
    """Tokens generated, and why fewer than asked when that happened."""
    if run.error:
        return f"{run.tokens} (failed)"
    return f"{run.tokens} (stopped)" if run.stopped else str(run.tokens)


def table(report: GenerationReport):
    """A rich Table of the report: one row per run, the reference first."""
    from rich.table import Table

    t = Table(title=f"{report.model} · {report.text or 'text'} · {len(report.prompt_ids) - 1}-token prompt, "
                    f"{report.settings['generate']} generated, seed {report.settings['seed']} "
                    f"(rescored ppl: full history; ×full = ratio to the full cache)")
    for name in ("run", "tokens", "rescored ppl", "×full", "distinct-4", "tok/s"):
        t.add_column(name, justify="left" if name == "run" else "right", no_wrap=True)
    for run in _all_runs(report):
        t.add_row(run.label, _tokens_cell(run), fmt_number(run.ppl), fmt_number(run.ratio, 3), fmt_number(run.distinct4, 3),
                  fmt_number(run.tokens_per_second, 1))
    if report.note:
        t.caption = report.note
    return t


CSV_COLUMNS = ("run", "policy", "budget", "tokens", "requested", "stopped", "error", "rescored_ppl", "ratio_to_full",
               "distinct4", "distinct4_words", "seconds", "tok_per_s", "max_live", "deletes", "repairs", "rebuilds")


def _csv_row(run: GenerationRun) -> list:
    return [run.label, run.policy, "full" if run.budget is None else run.budget, run.tokens, run.requested,
            run.stopped, run.error or "", fmt_number(run.ppl, 4), fmt_number(run.ratio, 4), fmt_number(run.distinct4, 4),
            fmt_number(run.distinct4_words, 4), f"{run.seconds:.2f}", fmt_number(run.tokens_per_second, 2), run.max_live,
            run.deletes, run.repairs, run.rebuilds]


def _run_json(run: GenerationRun) -> dict:
    data = dataclasses.asdict(run)
    data["nll"] = [round(x, 4) for x in run.nll]
    data.update(label=run.label, tokens=run.tokens, tok_per_s=run.tokens_per_second)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in data.items()}  # NaN is not JSON


def _fenced(text: str) -> str:
    """`text` in a code fence longer than any backtick run inside it (so it cannot close early)."""
    fence = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence}text\n{text}\n{fence}"


def side_by_side(report: GenerationReport) -> str:
    """Markdown: the settings, the prompt, then each run's text under its own heading."""
    s = report.settings
    lines = [f"# Generation: {report.model}, {s['generate']} tokens per run", "",
             f"Prompt: the first {s['prompt_tokens']} tokens of {report.text or 'the text'} (after BOS); seed "
             f"{s['seed']}, temperature {s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}, repetition "
             f"penalty {s['repetition_penalty']}.", ""]
    if report.note:
        lines += [f"Note: {report.note}", ""]
    lines += ["## Prompt", "", _fenced(report.prompt_text), ""]
    for run in _all_runs(report):
        facts = (f"{_tokens_cell(run)} tokens, rescored ppl {fmt_number(run.ppl)}, ×full {fmt_number(run.ratio, 3)}, "
                 f"distinct-4 {fmt_number(run.distinct4, 3)}, max live {run.max_live}")
        lines += [f"## {run.label}" + (" (full cache)" if run.budget is None else ""), "", facts + ".", ""]
        if run.error:
            lines += [f"Error: {run.error}", ""]
        lines += [_fenced(run.text), ""]
    return "\n".join(lines) + "\n"


def write_generation_outputs(report: GenerationReport, out: Path) -> dict[str, Path]:
    """Write generation.csv, generation.json, texts/<label>.txt and side_by_side.md into `out`
    (created). Returns their paths: keys csv, json, md, and texts (the folder)."""
    out = Path(out)
    try:
        (out / "texts").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create --out {out}: {exc.strerror or exc}") from None
    runs = _all_runs(report)
    paths = {"csv": out / "generation.csv", "json": out / "generation.json", "md": out / "side_by_side.md",
             "texts": out / "texts"}
    with open(paths["csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        writer.writerows(_csv_row(run) for run in runs)
    data = {"model": report.model, "text": report.text,
            "settings": {**report.settings, "prompt_text": report.prompt_text, "prompt_ids": report.prompt_ids},
            "note": report.note, "reference": _run_json(report.reference) if report.reference else None,
            "runs": [_run_json(run) for run in report.runs]}
    paths["json"].write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    for run in runs:
        (paths["texts"] / f"{run.label}.txt").write_text(run.text, encoding="utf-8", newline="")  # the exact text
    paths["md"].write_text(side_by_side(report), encoding="utf-8")
    return paths


# --- command line ---------------------------------------------------------------------------


def main(*, generate: int, model: str = "smollm2", text: Path | None = None, budgets=None, policies=None,
         prompt_tokens: int = DEFAULT_PROMPT_TOKENS, seed: int = 0, out: Path = Path("eval_results"),
         device: str | None = None, dtype: str | None = None, weights: str | None = None,
         **settings) -> GenerationReport:
    """`positronic eval --generate N`: check the flags, load the model, generate, re-score,
    print the table, write the files. `settings`: the runs' cache settings (RunSettings'
    fields). Returns the GenerationReport."""
    from rich.console import Console

    from ..models import load_model

    policies = list(policies or DEFAULT_POLICIES)
    budgets = list(budgets or DEFAULT_BUDGETS)
    check_settings(policies, budgets, generate=generate, prompt_tokens=prompt_tokens, **settings)
    body, name = read_text(text)
    lm = load_model(model, device=device, dtype=dtype, weights=weights)
    err = Console(stderr=True)

    def done(run: GenerationRun) -> None:  # without a terminal the bars do not redraw: one line per run
        if run.error:
            print(f"error: {run.label}: {run.error}", file=sys.stderr, flush=True)
        if not err.is_terminal:
            print(f"{run.label}: {_tokens_cell(run)} tokens in {run.seconds:.0f} s, rescored ppl {fmt_number(run.ppl, 3)}, "
                  f"distinct-4 {fmt_number(run.distinct4, 3)}", file=sys.stderr, flush=True)

    with progress_bars(err) as progress:
        report = evaluate_generation(lm, body, policies=policies, budgets=budgets, generate=generate,
                                     prompt_tokens=prompt_tokens, seed=seed, progress=progress, on_run=done,
                                     text_name=name, **settings)
    if report.note:
        print(f"note: {report.note}", file=sys.stderr)
    table_console().print(table(report))
    paths = write_generation_outputs(report, out)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return report
