"""bench/serve_load.py stays runnable: one level prints its table, and --levels compares client
counts round by round with ratios against the fewest (issue 32's targets are read off it),
the pooled p99 and time per output token of the streamed requests (TPOT) included."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_levels_compare_client_counts_with_ratios_against_the_fewest(run_script):
    out = run_script("serve_load", "--levels", "2", "1", "--rounds", "2", "--requests", "2",
                     "--max-tokens", "4", check=True).stdout
    runs = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"]) and len(line.split()) == 8]
    assert sorted((row[0], row[1]) for row in runs) == [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")]
    assert all(row[6:] == ["0", "0"] for row in runs)  # no failed request, no mixed session
    summary = {line.split()[0]: line.split() for line in out.splitlines()
               if line.split()[:1] in (["1"], ["2"]) and len(line.split()) == 12}
    assert summary["1"][2] == summary["1"][4] == summary["1"][6] == summary["1"][9] == "1.00x"  # the fewest vs itself
    two = summary["2"]
    assert float(two[1]) > 0 and float(two[3]) > 0 and two[2].endswith("x") and two[4].endswith("x")
    assert float(two[7]) >= float(two[5])  # p99 of every request, pooled: not below their p50
    assert float(two[8]) > 0 and two[9].endswith("x")  # time per output token of the streamed requests, pooled
    assert all(len(column.split("/")) == 2 and all(float(r) > 0 for r in column.split("/")) for column in two[10:])


def test_time_per_output_token_counts_the_tokens_after_the_first_text():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import serve_load
    finally:
        sys.path.remove(str(ROOT / "bench"))
    streamed = serve_load.Result("chat-stream", ok=True, total_s=1.0, first_s=0.1, completion_tokens=10)
    assert abs(streamed.per_token_s - 0.1) < 1e-12  # 9 tokens after the first in 0.9 s
    assert serve_load.Result("chat", ok=True, total_s=1.0, completion_tokens=10).per_token_s is None
    assert serve_load.Result("chat-stream", ok=True, total_s=1.0, first_s=0.1, completion_tokens=1).per_token_s is None


def test_bad_levels_are_refused_before_any_server_starts(run_script):
    done = run_script("serve_load", "--levels", "2", "2")
    assert done.returncode == 2 and "--levels names a client count twice" in done.stderr
    done = run_script("serve_load", "--levels", "0", "1")
    assert done.returncode == 2 and "at least 1" in done.stderr
    done = run_script("serve_load", "--levels", "8", "1", "--clients", "4")
    assert done.returncode == 2 and "give one of them" in done.stderr
    done = run_script("serve_load", "--rounds", "2")
    assert done.returncode == 2 and "give --levels too" in done.stderr
