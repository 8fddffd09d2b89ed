"""Which cells of the kvpress table are decided: paired bootstrap intervals on per-token NLLs.

    python bench/significance.py                       # the default against every press, every cell
    python bench/significance.py --method smartkv+recall --texts dracula --budgets 256 --block 32   # the gates alone rank memory
    python bench/significance.py --project-dir bench/eval_results/smartkv --kvpress-dir bench/eval_results/kvpress --method smartkv-brain   # AVX-512 runs (from 3e826ae)

The kvpress table (bench/results/kvpress.md) compares perplexities over the same 1,024 tokens, so
two methods' NLLs pair token by token. The perplexity ratio of method A to method B is
exp(mean(nll_A - nll_B)); this script gives it a 95% interval by a **moving-block bootstrap**
over token positions: blocks of --block consecutive differences (default 64) drawn with
replacement until --tokens are covered, --resamples times (default 10,000, seeded: the same
files give the same table). Blocks, because a row one method evicted and the other kept costs
over a stretch of tokens: neighbouring differences are not independent, and resampling single
tokens would make every interval too narrow.

For each text and budget it prints the project's method (--method, default
`smartkv+recall+recent`, the default policy since 2026-11-29; `smartkv+recall` ranks memory by the
gates alone) against each kvpress press that has per-token NLLs, nearest first, and
against the full cache:

    below / above   the interval of A / B lies wholly under / over 1: decided on these tokens
    tie             the interval holds 1: these 1,024 tokens cannot tell the two apart
    within / beyond (against the full cache, at the --target-at budgets) the interval lies wholly
                    under / over --target (1.03); undecided: it holds the target

With more than one text, the last rows pool them: every text's tokens at once (each text's
blocks drawn from that text alone), against each press run on all of them. One text's 1,024
tokens often tie where seven texts' 7,168 decide.

Inputs (written by the two benchmarks, each with the NLL of every scored token):
  --project-dir/smartkv_STEM.json     bench/smartkv.py --out (STEM: the text file's name)
  --kvpress-dir/TEXT_TOKENS_BUDGET_PRESS.json    bench/kvpress_anchor.py (--per-token reruns old ones)
bench/eval_results/ is not tracked, so a checkout has none until the benchmarks write them; the
runs behind the published tables are in git history: `git archive 3e826ae bench/eval_results | tar x`.
The full cache comes from the project's file; where kvpress's own full run has per-token NLLs
too, a note under the table says how far the two differ token by token (the same tokens, the
same model: they must agree to float rounding). numpy only: it runs in either virtualenv.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu_kernels import describe  # noqa: E402  (torch-free at import)
from bench.kvpress_anchor import MAIN, TEXTS  # noqa: E402  (torch-free at import)


@dataclass(frozen=True)
class Ratio:
    """Perplexity of A over B on the same tokens, and its bootstrap interval."""
    value: float
    low: float
    high: float

    def verdict(self, threshold: float = 1.0, words: tuple[str, str, str] = ("below", "above", "tie")) -> str:
        """words[0] if the interval lies wholly under `threshold`, words[1] if wholly over, else words[2]."""
        return words[0] if self.high < threshold else words[1] if self.low > threshold else words[2]


def paired_ratio(a, b, *, block: int = 64, resamples: int = 10_000, level: float = 0.95, seed: int = 0) -> Ratio:
    """exp(mean(a - b)) of two per-token NLL series over the same tokens, with a moving-block
    bootstrap interval (module docstring). `a` and `b` may also be lists of series, one per text
    (pooled: the mean over all their tokens; each text's blocks are drawn from that text alone).
    ValueError if paired series differ in length, are empty, hold a non-finite value, or the
    block is not in [1, the shortest series' length]."""
    pooled = _is_list_of_series(a)
    if pooled != _is_list_of_series(b) or pooled and len(a) != len(b):
        raise ValueError("two NLL series of one length (or two lists of them, text by text) are needed")
    pairs = list(zip(a, b)) if pooled else [(a, b)]
    diffs = []
    for x, y in pairs:
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if x.ndim != 1 or x.shape != y.shape or not x.size:
            raise ValueError(f"two NLL series of one length are needed, got {x.shape} and {y.shape}")
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise ValueError("an NLL series holds NaN or inf")
        diffs.append(x - y)
    shortest = min(d.size for d in diffs)
    if not 1 <= block <= shortest:
        raise ValueError(f"--block must be in [1, {shortest}] (the number of tokens), got {block}")
    if resamples < 100 or not 0 < level < 1:
        raise ValueError(f"need at least 100 resamples and a level in (0, 1), got {resamples} and {level}")
    rng = np.random.default_rng(seed)
    offsets = np.arange(block)
    total = sum(d.size for d in diffs)
    sums = np.zeros(resamples)
    for diff in diffs:
        n = diff.size
        per_draw = -(-n // block)  # blocks per resample, the last one cut to n tokens
        for first in range(0, resamples, 1000):  # 1,000 resamples at a time: ~8 MB of indices for 1,024 tokens
            count = min(1000, resamples - first)
            starts = rng.integers(0, n - block + 1, size=(count, per_draw))
            picked = (starts[:, :, None] + offsets).reshape(count, -1)[:, :n]
            sums[first:first + count] += diff[picked].sum(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(sums / total, [tail, 100 - tail])
    return Ratio(math.exp(sum(d.sum() for d in diffs) / total), math.exp(low), math.exp(high))


def _is_list_of_series(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and not np.isscalar(x[0])


def project_rows(path: Path, offset: int, tokens: int, kernels: dict) -> dict[tuple[str, int | None], list[float]]:
    """(method, budget) -> per-token NLLs from a bench/smartkv.py --out file; rows without
    them (files written before 2026-11-29) are left out. SystemExit if the file scored other tokens.
    `kernels`: each row's file and CPU kernels are added to it (see `one_kernels`)."""
    data = json.loads(path.read_text())
    if data["tokens"] != tokens:
        raise SystemExit(f"{path}: {data['tokens']} tokens scored, not {tokens}")
    rows = {}
    for row in data["rows"]:
        if "nll" not in row:
            continue
        if row.get("offset") != offset:
            raise SystemExit(f"{path}: method {row['method']} scored from character {row.get('offset')}, "
                             f"kvpress's table from {offset}: rerun bench/smartkv.py with --offset {offset}")
        rows[row["method"], row["budget"]] = row["nll"]
        kernels[f"{path} ({row['method']}, budget {row['budget']})"] = row.get("kernels")
    return rows


def kvpress_rows(directory: Path, text: str, tokens: int, kernels: dict) -> tuple[dict, dict]:
    """Every kvpress_anchor.py run of `text`: (press, budget) -> per-token NLLs of those that
    have them, and (press, budget) -> perplexity of those that do not (runs before 2026-11-29).
    `kernels`: each run's file and CPU kernels are added to it."""
    rows, bare = {}, {}
    for path in sorted(directory.glob(f"{text}_{tokens}_*.json")):
        row = json.loads(path.read_text())
        if row.get("offset") != TEXTS[text].offset:
            continue
        if "nll" in row:
            rows[row["method"], row["budget"]] = row["nll"]
        elif "ppl" in row:  # (a run that failed has neither)
            bare[row["method"], row["budget"]] = row["ppl"]
        else:
            continue
        kernels[str(path)] = row.get("kernels")
    return rows, bare


def one_kernels(kernels: dict[str, dict | None]) -> str:
    """The CPU kernels every recorded run used (bench/cpu_kernels.py: the same run rounds
    differently under others, and near-tie rankings then keep other rows), as one line.
    SystemExit naming one run of each if two differ; runs from before the record count as
    either."""
    kinds: dict[str, str] = {}
    for where, record in kernels.items():
        if record:
            kinds.setdefault(describe(record), where)
    if len(kinds) > 1:
        raise SystemExit("these runs used other CPU kernels, and their numbers do not pair (bench/cpu_kernels.py): "
                         + "; ".join(f"{where}: {kind}" for kind, where in kinds.items()))
    unrecorded = sum(record is None for record in kernels.values())
    head = next(iter(kinds), "not recorded")
    return head + (f" ({unrecorded} of {len(kernels)} runs from before the record)" if unrecorded and kinds else "")


@dataclass
class Loaded:
    """One text's per-token NLLs: the project's rows, kvpress's runs, the full cache."""
    label: str
    ours: dict[tuple[str, int | None], list[float]]
    theirs: dict[tuple[str, int | None], list[float]]
    bare: dict[tuple[str, int | None], float]  # kvpress runs without per-token NLLs: their perplexity only
    kernels: dict[str, dict | None]  # where each run came from -> its CPU kernels (None: not recorded)

    @property
    def full(self) -> list[float]:
        """The full cache's NLLs: the project's run of it (kvpress's agrees to float rounding)."""
        return self.ours["full", None]


def load(args) -> dict[str, Loaded]:
    """Every --texts text's series, with the --method rows at every budget (SystemExit naming the
    command that writes a missing one)."""
    loaded = {}
    for text in args.texts:
        spec = TEXTS[text]
        path = args.project_dir / f"smartkv_{Path(spec.file).stem}.json"
        rerun = (f"bench/smartkv.py --text {spec.file} --offset {spec.offset} --methods {args.method} "
                 f"--out {args.project_dir}")
        if not path.exists():
            raise SystemExit(f"{path} missing: run {rerun}")
        kernels: dict[str, dict | None] = {}
        ours = project_rows(path, spec.offset, args.tokens, kernels)
        if ("full", None) not in ours:
            raise SystemExit(f"{path} has no per-token NLLs of the full cache: rerun {rerun}")
        for budget in budgets(args):
            if (args.method, budget) not in ours:
                raise SystemExit(f"{path} has no per-token NLLs of {args.method} at budget {budget}: run {rerun}")
        theirs, bare = kvpress_rows(args.kvpress_dir, text, args.tokens, kernels)
        loaded[text] = Loaded(spec.label + ("*" if spec.held_out else ""), ours, theirs, bare, kernels)
    return loaded


def budgets(args) -> list[int]:
    return [round(share * args.tokens) for share in args.budgets]


def ppl(nll) -> float:
    return math.exp(float(np.mean(np.concatenate(nll) if _is_list_of_series(nll) else nll)))


def interval(args, a, b) -> Ratio:
    return paired_ratio(a, b, block=args.block, resamples=args.resamples, level=args.level)


def against_full(args, budget: int, r: Ratio) -> str:
    """The verdict against the full cache where the target is asked at this budget, else '–'."""
    if not any(round(share * args.tokens) == budget for share in args.target_at):
        return "–"
    return f"{r.verdict(args.target, ('within', 'beyond', 'undecided'))} {args.target:g}"


def intervals(args, loaded: dict[str, Loaded]) -> tuple[list[str], int]:
    """A row per text, budget and press (nearest first), then the full cache; pooled rows last.
    Also how many cells had no press with per-token NLLs."""
    lines = [f"{args.method} against kvpress's presses: perplexity ratio (A / B) and its {args.level:.0%} "
             f"interval, moving blocks of {args.block} tokens, {args.resamples:,} resamples", "",
             "| text | budget | A | B | ppl A | ppl B | A / B | interval | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    empty, notes = 0, []
    pooled: dict[int, dict[str, list]] = {}  # budget -> {"A": per text, "full cache": per text, press: per text}

    def row(label, budget, name, mine, other) -> str:
        r = interval(args, mine, other)
        verdict = against_full(args, budget, r) if name == "full cache" else r.verdict()
        return (f"| {label} | {budget} | {args.method} | {name} | {ppl(mine):.2f} | {ppl(other):.2f} | "
                f"{r.value:.4f} | {r.low:.4f}–{r.high:.4f} | {verdict} |")

    for text, data in loaded.items():
        if ("full", None) in data.theirs:
            gap = float(np.abs(np.subtract(data.full, data.theirs["full", None])).max())
            notes.append(f"- {data.label}: the project's and kvpress's full caches differ by at most {gap:.1e} "
                         "nats a token")
        for budget in budgets(args):
            mine = data.ours[args.method, budget]
            presses = [(name, nll) for (name, b), nll in data.theirs.items() if b == budget]
            into = pooled.setdefault(budget, {})
            for name, nll in [("A", mine), ("full cache", data.full), *presses]:
                into.setdefault(name, []).append(nll)
            if not presses:
                empty += 1
                lines.append(f"| {data.label} | {budget} | {args.method} | (no press with per-token NLLs) | "
                             f"{ppl(mine):.2f} | | | | |")
            for name, nll in sorted(presses, key=lambda item: ppl(item[1]))[: args.nearest or None]:
                lines.append(row(data.label, budget, name, mine, nll))
            lines.append(row(data.label, budget, "full cache", mine, data.full))
    if len(loaded) > 1:  # every text's tokens at once, against the presses run on all of them
        for budget, series in pooled.items():
            whole = [(name, v) for name, v in series.items() if name != "A" and len(v) == len(loaded)]
            for name, v in sorted(whole, key=lambda item: ppl(item[1])):
                lines.append(row(f"all {len(loaded)} texts, pooled", budget, name, series["A"], v))
    return lines + ([""] + notes if notes else []), empty


def ppl_table(args, loaded: dict[str, Loaded]) -> list[str]:
    """The kvpress table from the per-token files: perplexity and x the full cache per text and
    budget, a row per press (kvpress_anchor.py's order) and --method, and last the verdict
    against the nearest press in each cell. A run without per-token NLLs shows its perplexity
    marked † and takes no part in the verdicts."""
    heads = [f"{data.label} {budget}" for data in loaded.values() for budget in budgets(args)]
    lines = ["| method | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    names = [name for name in MAIN if name != "full" and any(
        (name, b) in data.theirs or (name, b) in data.bare for data in loaded.values() for b in budgets(args))]
    bare = False
    lines.append("| full cache | " + " | ".join(f"{ppl(data.full):.2f}" for data in loaded.values()
                                                 for _ in budgets(args)) + " |")
    for name in names + [args.method]:
        cells = []
        for data in loaded.values():
            for budget in budgets(args):
                nll = data.ours.get((name, budget)) if name == args.method else data.theirs.get((name, budget))
                if nll is None and (name, budget) in data.bare:
                    bare, value = True, data.bare[name, budget]
                    cells.append(f"{value:.2f} ×{value / ppl(data.full):.3f} †")
                else:
                    cells.append("–" if nll is None else f"{ppl(nll):.2f} ×{ppl(nll) / ppl(data.full):.3f}")
        label = f"**{args.method}**" if name == args.method else f"kvpress {name}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    verdicts = []
    for data in loaded.values():
        for budget in budgets(args):
            presses = [(ppl(nll), name, nll) for (name, b), nll in data.theirs.items() if b == budget]
            if not presses:
                verdicts.append("–")
                continue
            _, name, nll = min(presses, key=lambda item: item[0])
            verdicts.append(f"{interval(args, data.ours[args.method, budget], nll).verdict()} ({name})")
    lines.append("| against the nearest press | " + " | ".join(verdicts) + " |")
    if bare:
        lines += ["", "† a run without per-token NLLs (before 2026-11-29): its perplexity only, no verdict "
                  "(bench/kvpress_anchor.py --per-token reruns it)"]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", nargs="+", default=list(TEXTS), choices=list(TEXTS))
    p.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25], help="shares of --tokens")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--method", default="smartkv+recall+recent",
                   help="the project's row (bench/smartkv.py's method names; default: the default policy's)")
    p.add_argument("--nearest", type=int, default=0, help="only the N presses nearest in perplexity (0: all)")
    p.add_argument("--block", type=int, default=64, help="tokens per bootstrap block")
    p.add_argument("--resamples", type=int, default=10_000)
    p.add_argument("--level", type=float, default=0.95)
    p.add_argument("--target", type=float, default=1.03, help="the ratio to the full cache asked for")
    p.add_argument("--target-at", type=float, nargs="*", default=[0.25],
                   help="the budget shares the target is asked at (by default 25%%); other rows show no verdict")
    p.add_argument("--table", action="store_true", help="print the perplexity table of bench/results/kvpress.md "
                   "from the per-token files instead, with each cell's verdict against its nearest press")
    # the default's rows were measured on AVX2's kernels (2026-11-29), beside kvpress's rerun there;
    # bench/eval_results/ is not in git: the benchmarks write their runs there (those of the tables in
    # bench/results/ are in git history at 3e826ae); its smartkv/ and kvpress/ held the AVX-512
    # runs (smartkv+recall and before)
    p.add_argument("--project-dir", type=Path, default=ROOT / "bench" / "eval_results" / "smartkv_avx2")
    p.add_argument("--kvpress-dir", type=Path, default=ROOT / "bench" / "eval_results" / "kvpress_avx2")
    args = p.parse_args(argv)
    if not 1 <= args.block <= args.tokens:
        p.error(f"--block must be in [1, --tokens {args.tokens}], got {args.block}")
    if args.resamples < 100 or not 0 < args.level < 1:
        p.error("--resamples must be at least 100 and --level in (0, 1)")
    if args.nearest < 0:
        p.error(f"--nearest must be 0 (every press) or more, got {args.nearest}")
    loaded = load(args)
    kernels = one_kernels({where: record for data in loaded.values() for where, record in data.kernels.items()})
    if args.table:
        print("\n".join(ppl_table(args, loaded)))
        print(f"\nCPU kernels: {kernels}")
        return 0
    lines, empty = intervals(args, loaded)
    print("\n".join(lines))
    print(f"\nCPU kernels: {kernels}")
    if empty:
        print(f"\n{empty} cell(s) had no kvpress press with per-token NLLs: run bench/kvpress_anchor.py "
              "--per-token (in bench/.kvpress-venv)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
