"""bench/serve_load.py stays runnable: one level prints its table, and --levels compares client
counts round by round with ratios against the fewest (issue 32's targets are read off it)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "bench" / "serve_load.py")


def test_levels_compare_client_counts_with_ratios_against_the_fewest():
    out = subprocess.run([sys.executable, SCRIPT, "--levels", "2", "1", "--rounds", "2", "--requests", "2",
                          "--max-tokens", "4"], capture_output=True, text=True, timeout=600, check=True).stdout
    runs = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"]) and len(line.split()) == 8]
    assert sorted((row[0], row[1]) for row in runs) == [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")]
    assert all(row[6:] == ["0", "0"] for row in runs)  # no failed request, no mixed session
    summary = {line.split()[0]: line.split() for line in out.splitlines()
               if line.split()[:1] in (["1"], ["2"]) and len(line.split()) == 9}
    assert summary["1"][2] == summary["1"][4] == summary["1"][6] == "1.00x"  # the fewest against itself
    two = summary["2"]
    assert float(two[1]) > 0 and float(two[3]) > 0 and two[2].endswith("x") and two[4].endswith("x")
    assert all(len(column.split("/")) == 2 and all(float(r) > 0 for r in column.split("/")) for column in two[7:])


def test_bad_levels_are_refused_before_any_server_starts():
    done = subprocess.run([sys.executable, SCRIPT, "--levels", "2", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--levels names a client count twice" in done.stderr
    done = subprocess.run([sys.executable, SCRIPT, "--levels", "0", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "at least 1" in done.stderr
    done = subprocess.run([sys.executable, SCRIPT, "--levels", "8", "1", "--clients", "4"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "give one of them" in done.stderr
    done = subprocess.run([sys.executable, SCRIPT, "--rounds", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give --levels too" in done.stderr
