"""Which cells of the kvpress table are decided: paired bootstrap intervals on per-token NLLs.

    python bench/significance.py                       # the default against every press, every cell
    python bench/significance.py --method smartkv-brain --texts dracula --budgets 256 --block 32

The kvpress table (bench/results/kvpress.md) compares perplexities over the same 1,024 tokens, so
two methods' NLLs pair token by token. The perplexity ratio of method A to method B is
exp(mean(nll_A - nll_B)); this script gives it a 95% interval by a **moving-block bootstrap**
over token positions: blocks of --block consecutive differences (default 64) drawn with
replacement until --tokens are covered, --resamples times (default 10,000, seeded: the same
files give the same table). Blocks, because a row one method evicted and the other kept costs
over a stretch of tokens: neighbouring differences are not independent, and resampling single
tokens would make every interval too narrow.

For each text and budget it prints the project's method (--method, default `smartkv+recall`,
the default policy) against each kvpress press that has per-token NLLs, nearest first, and
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
The full cache comes from the project's file; where kvpress's own full run has per-token NLLs
too, the table's header says how far the two differ token by token (the same tokens, the same
model: they must agree to float rounding). numpy only: it runs in either virtualenv.
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

from bench.kvpress_anchor import TEXTS  # noqa: E402  (torch-free at import)


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
    pairs = list(zip(a, b)) if _is_list_of_series(a) else [(a, b)]
    if _is_list_of_series(a) != _is_list_of_series(b) or len(pairs) != (len(a) if _is_list_of_series(a) else 1) \
            or not pairs:
        raise ValueError("two NLL series of one length (or two lists of them, text by text) are needed")
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


def project_rows(path: Path, offset: int, tokens: int) -> dict[tuple[str, int | None], list[float]]:
    """(method, budget) -> per-token NLLs from a bench/smartkv.py --out file; rows without
    them (files written before 2026-11-29) are left out. SystemExit if the file scored other tokens."""
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
    return rows


def kvpress_rows(directory: Path, text: str, tokens: int) -> dict[tuple[str, int | None], list[float]]:
    """(press, budget) -> per-token NLLs of every kvpress_anchor.py run of `text` that has them."""
    rows = {}
    for path in sorted(directory.glob(f"{text}_{tokens}_*.json")):
        row = json.loads(path.read_text())
        if "nll" in row and row.get("offset") == TEXTS[text].offset:
            rows[row["method"], row["budget"]] = row["nll"]
    return rows


def report(args) -> tuple[str, int]:
    """The markdown table, and how many cells had no kvpress press with per-token NLLs."""
    lines = [f"{args.method} against kvpress's presses: perplexity ratio (A / B) and its {args.level:.0%} "
             f"interval, moving blocks of {args.block} tokens, {args.resamples:,} resamples", ""]
    lines += ["| text | budget | A | B (kvpress) | ppl A | ppl B | A / B | interval | verdict |",
              "|---|---|---|---|---|---|---|---|---|"]
    empty, notes = 0, []
    pooled: dict[int, dict[str, list]] = {}  # budget -> {"A": per text, "full cache": per text, press: per text}
    for text in args.texts:
        stem = Path(TEXTS[text].file).stem
        path = args.project_dir / f"smartkv_{stem}.json"
        if not path.exists():
            raise SystemExit(f"{path} missing: run bench/smartkv.py --text {TEXTS[text].file} --offset "
                             f"{TEXTS[text].offset} --methods {args.method} --out {args.project_dir}")
        ours = project_rows(path, TEXTS[text].offset, args.tokens)
        theirs = kvpress_rows(args.kvpress_dir, text, args.tokens)
        full = ours.get(("full", None))
        if full is None:
            raise SystemExit(f"{path} has no per-token NLLs of the full cache: rerun bench/smartkv.py --out")
        if ("full", None) in theirs:
            gap = float(np.abs(np.subtract(full, theirs["full", None])).max())
            notes.append(f"- {TEXTS[text].label}: the project's and kvpress's full caches differ by at most "
                         f"{gap:.1e} nats a token")
        label = TEXTS[text].label + ("*" if TEXTS[text].held_out else "")
        for budget in [round(share * args.tokens) for share in args.budgets]:
            mine = ours.get((args.method, budget))
            if mine is None:
                raise SystemExit(f"{path} has no per-token NLLs of {args.method} at budget {budget}: run "
                                 f"bench/smartkv.py --text {TEXTS[text].file} --offset {TEXTS[text].offset} "
                                 f"--methods {args.method} --out {args.project_dir}")
            ppl = math.exp(float(np.mean(mine)))
            into = pooled.setdefault(budget, {})
            for name, nll in [("A", mine), ("full cache", full)] + [(n, v) for (n, b), v in theirs.items() if b == budget]:
                into.setdefault(name, []).append(nll)
            presses = sorted((math.exp(float(np.mean(nll))), name) for (name, b), nll in theirs.items() if b == budget)
            if not presses:
                empty += 1
                lines.append(f"| {label} | {budget} | {args.method} | (no press with per-token NLLs) | {ppl:.2f} "
                             "| | | | |")
            for other, name in presses[: args.nearest or None]:
                r = paired_ratio(mine, theirs[name, budget], block=args.block, resamples=args.resamples,
                                 level=args.level)
                lines.append(f"| {label} | {budget} | {args.method} | {name} | {ppl:.2f} | {other:.2f} | "
                             f"{r.value:.4f} | {r.low:.4f}–{r.high:.4f} | {r.verdict()} |")
            r = paired_ratio(mine, full, block=args.block, resamples=args.resamples, level=args.level)
            asked = any(round(share * args.tokens) == budget for share in args.target_at)
            verdict = f"{r.verdict(args.target, ('within', 'beyond', 'undecided'))} {args.target:g}" if asked else "–"
            lines.append(f"| {label} | {budget} | {args.method} | full cache | {ppl:.2f} | "
                         f"{math.exp(float(np.mean(full))):.2f} | {r.value:.4f} | {r.low:.4f}–{r.high:.4f} | "
                         f"{verdict} |")
    if len(args.texts) > 1:
        lines += _pooled(args, pooled)
    return "\n".join(lines + ([""] + notes if notes else [])), empty


def _pooled(args, pooled: dict[int, dict[str, list]]) -> list[str]:
    """Rows over every text's tokens at once (each text's blocks drawn from it alone), against
    each press run on all of them: what the texts say together, where one text's 1,024 tokens tie."""
    texts = len(args.texts)
    rows = []
    for budget, series in pooled.items():
        mine = series["A"]
        ppl = math.exp(float(np.mean(np.concatenate(mine))))
        others = sorted((math.exp(float(np.mean(np.concatenate(v)))), name) for name, v in series.items()
                        if name != "A" and len(v) == texts)
        for other, name in others:
            r = paired_ratio(mine, series[name], block=args.block, resamples=args.resamples, level=args.level)
            verdict = r.verdict()
            if name == "full cache":
                asked = any(round(share * args.tokens) == budget for share in args.target_at)
                verdict = f"{r.verdict(args.target, ('within', 'beyond', 'undecided'))} {args.target:g}" if asked else "–"
            rows.append(f"| all {texts} texts, pooled | {budget} | {args.method} | {name} | {ppl:.2f} | {other:.2f} | "
                        f"{r.value:.4f} | {r.low:.4f}–{r.high:.4f} | {verdict} |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", nargs="+", default=list(TEXTS), choices=list(TEXTS))
    p.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25], help="shares of --tokens")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--method", default="smartkv+recall", help="the project's row (bench/smartkv.py's method names)")
    p.add_argument("--nearest", type=int, default=0, help="only the N presses nearest in perplexity (0: all)")
    p.add_argument("--block", type=int, default=64, help="tokens per bootstrap block")
    p.add_argument("--resamples", type=int, default=10_000)
    p.add_argument("--level", type=float, default=0.95)
    p.add_argument("--target", type=float, default=1.03, help="the ratio to the full cache asked for")
    p.add_argument("--target-at", type=float, nargs="*", default=[0.25],
                   help="the budget shares the target is asked at (issue 35: 25%%); other rows show no verdict")
    p.add_argument("--project-dir", type=Path, default=ROOT / "bench" / "eval_results" / "smartkv")
    p.add_argument("--kvpress-dir", type=Path, default=ROOT / "bench" / "eval_results" / "kvpress")
    args = p.parse_args(argv)
    if not 1 <= args.block <= args.tokens:
        p.error(f"--block must be in [1, --tokens {args.tokens}], got {args.block}")
    if args.resamples < 100 or not 0 < args.level < 1:
        p.error("--resamples must be at least 100 and --level in (0, 1)")
    table, empty = report(args)
    print(table)
    if empty:
        print(f"\n{empty} cell(s) had no kvpress press with per-token NLLs: run bench/kvpress_anchor.py "
              "--per-token (in bench/.kvpress-venv)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
