"""bench/significance.py: the intervals mean what the kvpress table's verdicts say they mean, and the
script reads what bench/smartkv.py writes."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.significance import paired_ratio  # noqa: E402


def _ar1(rng, n: int, phi: float) -> np.ndarray:
    """Noise in which neighbours are correlated, as per-token NLL differences are (one evicted row
    costs over a stretch of tokens)."""
    noise, out = rng.normal(0, 1, n), np.empty(n)
    out[0] = noise[0]
    for t in range(1, n):
        out[t] = phi * out[t - 1] + noise[t]
    return out


def _coverage(block: int) -> int:
    """Of 100 pairs whose true ratio is 1 (correlated noise of mean 0 added), how many intervals hold 1."""
    hits = 0
    for trial in range(100):
        rng = np.random.default_rng(trial)
        b = rng.gamma(2, 1.5, 1024)
        r = paired_ratio(b + 0.3 * _ar1(rng, 1024, 0.9), b, block=block, resamples=1000, seed=trial)
        hits += r.low <= 1 <= r.high
    return hits


def test_block_intervals_hold_the_true_ratio_where_token_by_token_ones_would_call_ties_decided():
    assert _coverage(64) >= 88  # 95% intervals: 93 of 100 with these seeds
    assert _coverage(1) <= 50  # resampling single tokens: 35 of 100, a tie called "decided" two times in three


def test_the_same_series_tie_and_a_clear_shift_is_decided_either_way():
    rng = np.random.default_rng(0)
    b = rng.gamma(2, 1.5, 1024)
    same = paired_ratio(b, b)
    assert (same.value, same.low, same.high) == (1.0, 1.0, 1.0) and same.verdict() == "tie"
    worse = paired_ratio(b + 0.1, b)
    assert worse.value == pytest.approx(math.exp(0.1)) and worse.verdict() == "above"
    better = paired_ratio(b - 0.1 + 0.3 * rng.normal(size=1024), b)
    assert better.low < better.value < better.high < 1 and better.verdict() == "below"
    assert better.verdict(1.03, ("within", "beyond", "undecided")) == "within"


def test_texts_pooled_weigh_every_token_and_tighten_the_interval():
    rng = np.random.default_rng(5)
    b1, b2 = rng.gamma(2, 1.5, 1024), rng.gamma(2, 1.5, 512)
    a1, a2 = b1 + 0.02 + 0.3 * _ar1(rng, 1024, 0.9), b2 + 0.05 + 0.3 * _ar1(rng, 512, 0.9)
    both = paired_ratio([a1, a2], [b1, b2])
    assert both.value == pytest.approx(math.exp((np.sum(a1 - b1) + np.sum(a2 - b2)) / 1536))
    one = paired_ratio(a1, b1)
    assert both.high - both.low < one.high - one.low  # 1,536 tokens tell more than 1,024
    with pytest.raises(ValueError, match="or two lists of them"):
        paired_ratio([a1, a2], [b1])
    with pytest.raises(ValueError, match=r"--block must be in \[1, 512\]"):
        paired_ratio([a1, a2], [b1, b2], block=600)


@pytest.mark.parametrize("a, b, kwargs, message", [
    ([1.0, 2.0], [1.0], {}, "one length"),
    ([], [], {}, "one length"),
    ([1.0, float("nan")], [1.0, 2.0], {}, "NaN or inf"),
    ([1.0, 2.0], [1.0, 2.0], {"block": 3}, "--block must be in [1, 2]"),
    ([1.0, 2.0], [1.0, 2.0], {"block": 1, "resamples": 10}, "at least 100 resamples"),
])
def test_series_that_do_not_pair_are_refused(a, b, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        paired_ratio(a, b, **kwargs)


def test_the_table_pairs_what_bench_smartkv_wrote_with_a_kvpress_run(tmp_path, run_script):
    """bench/smartkv.py --out keeps each row's per-token NLLs and adds a --methods run to the file;
    bench/significance.py reads it beside a kvpress_anchor.py JSON (here: the project's own
    streaming row written as one, so the expected ratio is known)."""
    text = tmp_path / "frankenstein.txt"  # significance.py finds a text's file by kvpress_anchor's table
    alice = (ROOT / "texts" / "alice_ch1-2.txt").read_text(encoding="utf-8")
    text.write_text(alice * (1 + 70_000 // len(alice)), encoding="utf-8")
    out = tmp_path / "project"
    common = ["--model", "random:tiny", "--text", str(text), "--tokens", "128", "--budgets", "0.5", "--out", str(out)]
    for method in ("streaming", "smartkv-random"):
        run_script("smartkv", *common, "--methods", method, check=True)
    rows = {(row["method"], row["budget"]): row for row in
            json.loads((out / "smartkv_frankenstein.json").read_text())["rows"]}
    assert set(rows) == {("full", None), ("streaming", 64), ("smartkv-random", 64)}  # the first run's row kept
    for row in rows.values():
        assert len(row["nll"]) == 128 and math.exp(np.mean(row["nll"])) == pytest.approx(row["ppl"], rel=1e-5)

    kvpress = tmp_path / "kvpress"
    kvpress.mkdir()
    (kvpress / "frankenstein_128_64_streaming.json").write_text(json.dumps(
        {"method": "streaming", "budget": 64, "offset": 60000, "nll": rows["streaming", 64]["nll"]}))
    run = run_script("significance", "--texts", "frankenstein",
                     "--tokens", "128", "--budgets", "0.5", "--target-at", "0.5", "--method", "smartkv-random", "--block", "16",
                     "--project-dir", str(out), "--kvpress-dir", str(kvpress), check=True)
    cells = {line.split(" | ")[3]: line.strip("| ").split(" | ") for line in run.stdout.splitlines()
             if line.startswith("| Frankenstein |")}
    assert set(cells) == {"streaming", "full cache"}
    want = math.exp(np.mean(np.subtract(rows["smartkv-random", 64]["nll"], rows["streaming", 64]["nll"])))
    value, interval, verdict = cells["streaming"][6:9]
    low, high = map(float, interval.split("–"))
    assert float(value) == pytest.approx(want, abs=1e-4) and low <= float(value) <= high
    assert verdict == ("below" if high < 1 else "above" if low > 1 else "tie")
    assert cells["full cache"][8].split()[0] in {"within", "beyond", "undecided"}

    (kvpress / "frankenstein_128_64_knorm.json").write_text(json.dumps(  # an old run: its perplexity only
        {"method": "knorm", "budget": 64, "offset": 60000, "ppl": 99.5}))
    table = run_script("significance", "--texts", "frankenstein",
                       "--tokens", "128", "--budgets", "0.5", "--method", "smartkv-random", "--block", "16",
                       "--project-dir", str(out), "--kvpress-dir", str(kvpress), "--table", check=True).stdout.splitlines()
    assert table[2].startswith(f"| full cache | {rows['full', None]['ppl']:.2f} |")
    assert table[3] == f"| kvpress streaming | {rows['streaming', 64]['ppl']:.2f} ×{rows['streaming', 64]['ratio']:.3f} |"
    assert table[4] == f"| kvpress knorm | 99.50 ×{99.5 / rows['full', None]['ppl']:.3f} † |"
    assert table[5].startswith(f"| **smartkv-random** | {rows['smartkv-random', 64]['ppl']:.2f} ×")
    assert table[6] == f"| against the nearest press | {verdict} (streaming) |"  # not the old run's
    assert table[-3].startswith("† a run without per-token NLLs")
    kernels = rows["full", None]["kernels"]["cpu"]  # what bench/smartkv.py recorded; the old runs none
    assert table[-1] == f"CPU kernels: {kernels} (2 of 5 runs from before the record)"

    # a press run on another CPU's kernels rounds otherwise: its numbers do not pair with these
    (kvpress / "frankenstein_128_64_tova.json").write_text(json.dumps(
        {"method": "tova", "budget": 64, "offset": 60000, "nll": rows["streaming", 64]["nll"],
         "kernels": {"cpu": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}))
    mixed = run_script("significance", "--texts", "frankenstein",
                       "--tokens", "128", "--budgets", "0.5", "--method", "smartkv-random",
                       "--project-dir", str(out), "--kvpress-dir", str(kvpress))
    assert mixed.returncode != 0 and "Traceback" not in mixed.stderr and not mixed.stdout
    assert "used other CPU kernels" in mixed.stderr
    assert "frankenstein_128_64_tova.json: AVX2 (ONEDNN_MAX_CPU_ISA=AVX2)" in mixed.stderr


def test_a_missing_project_file_names_the_command_that_writes_it(tmp_path, run_script):
    run = run_script("significance", "--texts", "dracula",
                     "--project-dir", str(tmp_path), "--kvpress-dir", str(tmp_path))
    assert run.returncode != 0 and "smartkv_dracula.json missing: run bench/smartkv.py --text dracula.txt" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("flags, message", [
    (["--nearest", "-1"], "--nearest must be 0 (every press) or more, got -1"),
    (["--block", "0"], "--block must be in [1, --tokens 1024], got 0"),
    (["--resamples", "10"], "--resamples must be at least 100"),
])
def test_bad_options_are_refused_with_one_line_before_any_file_is_read(tmp_path, flags, message, run_script):
    run = run_script("significance", *flags,
                     "--project-dir", str(tmp_path / "none"), "--kvpress-dir", str(tmp_path / "none"))
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr and not run.stdout
