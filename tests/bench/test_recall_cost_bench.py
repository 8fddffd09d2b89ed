"""bench/recall_cost.py stays runnable: a tick timed with the default's recall index full at each
capacity, and the shipped capacity left as it was."""

import pytest

from positronic.smartkv.policy import SmartKVPolicy


@pytest.mark.smollm2  # the default policy with recall needs gates: the embedded model's ship
def test_each_capacity_fills_its_index_and_the_shipped_one_stays(run_script):
    out = run_script("recall_cost", "--budget", "64", "--capacities", "64", "128", "--ticks", "2",
                     "--repeats", "1", check=True).stdout
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ") and "capacity" not in line]
    assert [(int(row[0]), int(row[1])) for row in rows] == [(64, 64), (128, 128)]  # each index full
    assert float(rows[0][4]) == 1.0 and float(rows[1][2]) > 0
    assert SmartKVPolicy.recall_capacity == 4096


def test_settings_it_cannot_run_are_refused_before_the_model_loads(run_script):
    done = run_script("recall_cost", "--capacities", "0", "64")
    assert done.returncode == 2 and "--capacities must be >= 1, got 0" in done.stderr
    done = run_script("recall_cost", "--ticks", "0")
    assert done.returncode == 2 and "--ticks must be >= 1, got 0" in done.stderr
