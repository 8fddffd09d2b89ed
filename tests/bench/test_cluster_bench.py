"""bench/cluster.py stays runnable: the plain server and `serve --replicas 2` side by side, one
client's tokens/s through each and their ratio, and every request on its session's replica."""

import importlib.util
import re

import pytest


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed (the cluster extra)")
def test_the_table_compares_one_client_and_counts_requests_on_their_sessions_replica(run_script):
    out = run_script("cluster", "--rounds", "1", "--requests", "2", "--max-tokens", "4", "--sessions", "4",
                     "--affinity-requests", "12", "--budget", "96", "-t", "1", check=True).stdout
    ratio = re.search(r"\| cluster / plain, by round; median \| ([\d.]+); \*\*([\d.]+)x\*\* \|", out)
    assert ratio and float(ratio.group(1)) == float(ratio.group(2)) > 0, out
    assert "| affinity: requests answered by their session's replica | **12 of 12** (4 sessions; 0 failed) |" in out
    assert "| replicas' own metrics: sessions held by another replica than their requests' | 0 |" in out
    spread = re.search(r"\| sessions per replica \| replica-0: (\d+), replica-1: (\d+) \|", out)
    assert spread and int(spread.group(1)) + int(spread.group(2)) == 4, out
