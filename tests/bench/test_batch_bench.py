"""bench/batch.py stays runnable: a tiny run prints a row per policy and size, and batched
tokens equal alone (its exit status says so); the stall mode prints its gaps."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_batch_bench_prints_a_row_per_policy_and_size_and_batched_equals_alone(run_script):
    out = run_script("batch", "--model", "random:tiny", "--budget", "48", "--sizes", "1", "3",
                     "--ticks", "4", "--repeats", "1", "--policies", "streaming", "brightness", check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["streaming"], ["brightness"])]
    assert [(row[0], row[1]) for row in rows] == [("streaming", "1"), ("streaming", "3"), ("brightness", "1"),
                                                  ("brightness", "3")]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 and row[-1].endswith("x") for row in rows)
    assert "MISMATCH" not in out


def test_the_stall_mode_says_how_long_a_long_prompt_holds_the_others_up(run_script):
    out = run_script("batch", "--model", "random:tiny", "--budget", "48", "--stall", "300",
                     "--chunks", "64", check=True).stdout
    assert "before batching: the other sequence waits" in out
    assert "batched, chunks of   64" in out and "longest gap" in out
