"""`positronic eval`: check the flags, load the model, run, print the table, write the files."""

from __future__ import annotations

import sys
from pathlib import Path

from ..policies import POLICIES
from ..texts import DEFAULT_TEXT  # texts/alice_ch1-2.txt, shipped as package data
from ..util import read_text_file
from .report import progress_bars, table, table_console, write_outputs
from .stream import EvalError, make_config, takes_evict_every
from .sweep import DEFAULT_BUDGETS, DEFAULT_POLICIES, EvalReport, RunSummary, evaluate, recallable


def most_tokens(text: str) -> int:
    """More tokens than any tokenizer makes of `text`: every token covers a byte at least, but
    for the word-start marker SentencePiece may put alone before the first one."""
    return len(text.encode("utf-8")) + 1


def read_text(path: Path | None) -> tuple[str, str]:
    """(text, its display name); OSError/EvalError with one-line messages."""
    path = Path(path) if path is not None else DEFAULT_TEXT
    text = read_text_file(path, "--text")
    if not text.strip():
        raise EvalError(f"--text {path} is empty")
    return text, path.name


# eval's options that set a run's BrainConfig field of the same name
SETTING_FLAGS = ("budget", "sinks", "protect", "at_capacity", "repairer", "repair_batch", "evict_every", "kv_format",
                 "kv_store",
                 "gates", "memory_rank")


def _flagged(message: str) -> str:
    """A setting's message with its leading field name written as eval's flag ("sinks must be
    >= 0" -> "--sinks must be >= 0")."""
    field = message.split(" ", 1)[0].rstrip(":")
    return "--" + field.replace("_", "-") + message[len(field):] if field in SETTING_FLAGS else message


def default_sweep(model: str, budget: int, *, sinks: int, protect: int, gates: str,
                  memory_rank: str | None) -> tuple[list[str], tuple[str, ...]]:
    """The policies an eval without --policy runs: DEFAULT_POLICIES and the one `run` and `serve`
    pick for `model` (brain/defaults.py: SmartKV with recall where gates ship for it, its rank
    the default's), as the smallest budget allows; and those of them that run with recall."""
    from ..brain.config import BrainConfig
    from ..brain.defaults import default_policy

    try:
        config = BrainConfig(budget=budget, sinks=sinks, protect=protect, gates=gates)
    except (TypeError, ValueError):  # the flags' own checks say what is wrong, below
        return list(DEFAULT_POLICIES), ()
    choice = default_policy(model, config, recall=None, memory_rank=memory_rank)
    if choice.policy in DEFAULT_POLICIES and not choice.recall:
        return list(DEFAULT_POLICIES), ()
    return [*DEFAULT_POLICIES, choice.policy], ((choice.policy,) if choice.recall else ())


def check_policies(policies: list[str], *, gates: str, memory_rank: str | None, evict_every: int,
                   recall: bool) -> None:
    """EvalError for an unknown policy, and for a setting that none of `policies` reads (it would
    go unused)."""
    for name in policies:
        if name not in POLICIES:
            raise EvalError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    if not any(POLICIES[name].per_layer for name in policies):
        for flag, value in (("--gates", gates), ("--memory-rank", memory_rank)):
            if value:
                raise EvalError(f"{flag} applies to policy smartkv, which is not among the --policy runs")
    if evict_every and not any(takes_evict_every(name) for name in policies):
        raise EvalError("--evict-every applies to the shared-row policies (brightness, streaming, scored, h2o, "
                        "random), none of which is among the --policy runs")
    if recall and not any(recallable(name) for name in policies):
        raise EvalError("--recall adds runs with recall of the policies that evict; --policy none evicts nothing")


def main(*, model: str = "smollm2", text: Path | None = None, budgets=None, policies=None, max_tokens: int = 1024,
         out: Path = Path("eval_results"), segments: int = 8, sinks: int = 4, protect: int = 0,
         at_capacity: str = "shift", probe: bool = True, probe_filler: int | None = None, device: str | None = None,
         dtype: str | None = None, weights: str | None = None, smooth: int | None = None, repairer: str | None = None,
         repair_batch: int | None = None, evict_every: int = 0, probe_at: float = 0.0, recall: bool = False,
         kv_format: str = "float", gates: str = "", kv_store: str = "splice", memory_rank: str | None = None) -> EvalReport:
    """`positronic eval`: check the flags, load the model, run, print the table, write the files."""
    from rich.console import Console

    from ..models import load_model

    budgets = list(budgets or DEFAULT_BUDGETS)
    recalled: tuple[str, ...] = ()
    if not policies:  # the sweep of the shared-row policies, and the product's own default for the model
        policies, recalled = default_sweep(model, min(budgets), sinks=sinks, protect=protect, gates=gates,
                                           memory_rank=memory_rank)
    policies = list(policies)
    check_policies(policies, gates=gates, memory_rank=memory_rank, evict_every=evict_every, recall=recall)
    for budget in budgets:
        for name in policies:
            for on in {False, recall and recallable(name)}:
                try:
                    make_config(name, budget, sinks=sinks, protect=protect, at_capacity=at_capacity,
                                repairer=repairer, repair_batch=repair_batch,
                                evict_every=evict_every, recall=on, kv_format=kv_format,
                                gates=gates, kv_store=kv_store, memory_rank=memory_rank)
                except EvalError as exc:
                    raise EvalError(_flagged(str(exc))) from None
    if max_tokens < 2:
        raise EvalError(f"--max-tokens must be >= 2, got {max_tokens}")
    if segments < 1:
        raise EvalError(f"--segments must be >= 1, got {segments}")
    if smooth is not None and smooth < 1:
        raise EvalError(f"--smooth must be >= 1, got {smooth}")
    if probe and not 0.0 <= probe_at <= 1.0:
        raise EvalError(f"--probe-at must be a fraction in 0..1, got {probe_at}")
    if probe and probe_filler is not None and probe_filler < 0:
        raise EvalError(f"--probe-filler must be >= 0, got {probe_filler}")
    body, name = read_text(text)
    if probe and probe_filler is not None and probe_filler > most_tokens(body):
        raise EvalError(f"--probe-filler {probe_filler} is more tokens than any tokenizer makes of --text {name} "
                        f"({len(body.encode('utf-8'))} bytes)")
    lm = load_model(model, device=device, dtype=dtype, weights=weights)
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
                          evict_every=evict_every,
                          probe_at=probe_at, recall=recall, kv_format=kv_format, gates=gates, kv_store=kv_store,
                          memory_rank=memory_rank, recalled=recalled, progress=progress,
                          on_run=done,
                          text_name=name)
    table_console().print(table(report))
    paths = write_outputs(report, out, smooth=smooth)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return report
