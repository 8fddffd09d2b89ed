"""What an evaluation shows and writes: the results table, results.csv, results.json and the
NLL-over-position plot; the table console and progress bars generation_eval shares."""

from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from .probe import ProbeResult
from .sweep import EvalReport, RunSummary


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
    try:
        plot(report, paths["png"], smooth=smooth)
    except ModuleNotFoundError as exc:  # matplotlib is the [eval] extra: the tables are written, the plot said missing
        del paths["png"]
        print(f"note: no plot written ({exc.name} is not installed: pip install 'positronic-brain[eval]')",
              file=sys.stderr)
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


# each policy its own colour: the full cache is black, the budget line grey, recall a dash-dot of its policy's
COLORS = {"brightness": "tab:orange", "streaming": "tab:blue", "scored": "tab:green", "h2o": "tab:red",
          "none": "tab:purple", "smartkv": "tab:brown", "random": "tab:pink"}
SPARE = ("tab:olive", "tab:cyan", "gold", "navy", "teal", "maroon")


def policy_colors(policies: list[str]) -> dict[str, str]:
    """A colour per policy, no two alike: the fixed ones, then spares for a policy registered
    later (matplotlib's cycle would give it a colour another policy already has)."""
    colors, spare = {}, iter(SPARE)
    for policy in dict.fromkeys(policies):
        colors[policy] = COLORS.get(policy) or next(spare, "black")
    return colors


def plot(report: EvalReport, path: Path, *, smooth: int | None = None) -> None:
    """NLL over position (moving average), one subplot per budget, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = list(dict.fromkeys(run.budget for run in report.runs))
    window = smooth or max(8, (report.stream_tokens - 1) // 16)
    fig, axes = plt.subplots(len(budgets), 1, figsize=(10, 3.2 * len(budgets)), sharex=True, squeeze=False)
    colors = policy_colors([run.policy for run in report.runs])
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

