"""`positronic eval`: check the flags, load the model, run, print the table, write the files."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..policies import POLICIES
from ..texts import DEFAULT_TEXT  # texts/alice_ch1-2.txt, shipped as package data
from ..util import read_text_file
from .report import progress_bars, table, table_console, write_outputs
from ..brain.config import AUTO_GATES
from .stream import EvalError, RunSettings, takes_evict_every
from .sweep import DEFAULT_BUDGETS, DEFAULT_POLICIES, EvalReport, RunSummary, evaluate, recallable

if TYPE_CHECKING:
    from ..brain.config import BrainConfig


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
                 "kv_store", "gates", "memory_rank", "reread", "policy_options")


def _flagged(message: str) -> str:
    """A setting's message with its leading field name written as eval's flag ("sinks must be
    >= 0" -> "--sinks must be >= 0", "policy_options: ..." -> "--policy-option: ...")."""
    field = message.split(" ", 1)[0].rstrip(":")
    if field not in SETTING_FLAGS:
        return message
    return "--" + field.removesuffix("s" if field == "policy_options" else "").replace("_", "-") + message[len(field):]


def default_sweep(model: str, budget: int, cache: RunSettings) -> tuple[list[str], tuple[str, ...], str]:
    """The policies an eval without --policy runs: DEFAULT_POLICIES and the one `run` and `serve`
    pick for `model` (brain/defaults.py: SmartKV with recall where gates ship for it or can be
    trained on its first use, its rank the default's), as the smallest budget allows; those of
    them that run with recall; and the gates they need ("auto" for gates trained on first use,
    else the --gates given)."""
    from ..brain.config import BrainConfig
    from ..brain.defaults import default_policy

    try:
        config = BrainConfig(budget=budget, sinks=cache.sinks, protect=cache.protect, gates=cache.gates)
    except (TypeError, ValueError):  # the flags' own checks say what is wrong, below
        return list(DEFAULT_POLICIES), (), cache.gates
    choice = default_policy(model, config, recall=None, memory_rank=cache.memory_rank, train=True)
    if choice.policy in DEFAULT_POLICIES and not choice.recall:
        return list(DEFAULT_POLICIES), (), cache.gates
    return [*DEFAULT_POLICIES, choice.policy], ((choice.policy,) if choice.recall else ()), choice.gates or cache.gates


def check_policies(policies: list[str], cache: RunSettings, *, recall: bool) -> None:
    """EvalError for an unknown policy, and for a setting that none of `policies` reads (it would
    go unused)."""
    for name in policies:
        if name not in POLICIES:
            raise EvalError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    if not any(POLICIES[name].per_layer for name in policies):
        for flag, value in (("--gates", cache.gates), ("--memory-rank", cache.memory_rank),
                            ("--reread" if cache.reread else "--no-reread", cache.reread is not None)):
            if value:
                raise EvalError(f"{flag} applies to policy smartkv, which is not among the --policy runs")
    if cache.evict_every and not any(takes_evict_every(name) for name in policies):
        raise EvalError("--evict-every applies to the shared-row policies (brightness, streaming, scored, h2o, "
                        "random), none of which is among the --policy runs")
    if cache.policy_options and not any(hasattr(POLICIES[name], "press_class") for name in policies):
        pressed = ", ".join(name for name, cls in POLICIES.items() if hasattr(cls, "press_class"))
        raise EvalError(f"--policy-option sets a press's own settings: it applies to the policies made from a press "
                        f"({pressed}), none of which is among the --policy runs")
    if recall and not any(recallable(name) for name in policies):
        raise EvalError("--recall adds runs with recall of the policies that evict; --policy none evicts nothing")


def trained_gates(lm, settings: dict) -> dict:
    """`settings` with gates "auto" made a file before any run (kept gates, or trained now:
    smartkv/first_use.py), so a model with nothing to learn is refused before the work starts."""
    if settings.get("gates") != AUTO_GATES:
        return settings
    from ..smartkv.first_use import GateTrainingError, resolve

    try:
        return settings | {"gates": resolve(lm)}
    except GateTrainingError as exc:
        raise EvalError(f"--gates auto: {exc}") from None


def run_settings(settings: dict, policies: list[str], budgets: list[int], *,
                 recall: bool, recalled: tuple[str, ...] = ()) -> dict[tuple[str, bool, int], BrainConfig]:
    """Every run's BrainConfig, keyed (policy, recall, budget): the eval's `settings`
    (RunSettings' fields) checked against its policies, each error worded with eval's flags.
    `recall` adds a run with recall of every policy that can; `recalled`: those that run with
    recall alone."""
    cache = RunSettings.of(settings)
    check_policies(policies, cache, recall=recall)
    configs = {}
    for budget in budgets:
        for name in policies:
            for on in dict.fromkeys((name in recalled, recall and recallable(name))):
                try:
                    configs[name, on, budget] = cache.config(name, budget, recall=on)
                except EvalError as exc:
                    raise EvalError(_flagged(str(exc))) from None
    return configs


def main(*, model: str = "smollm2", text: Path | None = None, budgets=None, policies=None, max_tokens: int = 1024,
         out: Path = Path("eval_results"), segments: int = 8, probe: bool = True, probe_filler: int | None = None,
         device: str | None = None, dtype: str | None = None, weights: str | None = None, smooth: int | None = None,
         probe_at: float = 0.0, recall: bool = False, **settings) -> EvalReport:
    """`positronic eval`: check the flags, load the model, run, print the table, write the files.
    `settings`: the runs' cache settings (RunSettings' fields)."""
    from rich.console import Console

    from ..models import load_model

    budgets = list(budgets or DEFAULT_BUDGETS)
    recalled: tuple[str, ...] = ()
    if not policies:  # the sweep of the shared-row policies, and the product's own default for the model
        policies, recalled, gates = default_sweep(model, min(budgets), RunSettings.of(settings))
        settings = settings | {"gates": gates}
    policies = list(policies)
    run_settings(settings, policies, budgets, recall=recall, recalled=recalled)
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
    settings = trained_gates(lm, settings)
    err = Console(stderr=True)

    def done(run: RunSummary) -> None:  # without a terminal the bars do not redraw: one line per run
        if not err.is_terminal:
            answer = f", answer NLL {run.probe.nll:.2f}" if run.probe else ""
            print(f"{run.label}: ppl {run.ppl:.3f} over {run.tokens} tokens{answer} in {run.seconds:.0f} s",
                  file=sys.stderr, flush=True)

    with progress_bars(err) as progress:
        report = evaluate(lm, body, policies=policies, budgets=budgets, max_tokens=max_tokens, segments=segments,
                          probe=probe, probe_filler=probe_filler, probe_at=probe_at, recall=recall, recalled=recalled,
                          progress=progress, on_run=done, text_name=name, **settings)
    table_console().print(table(report))
    paths = write_outputs(report, out, smooth=smooth)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return report
