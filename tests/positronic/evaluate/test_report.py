"""positronic.evaluate.report: the probe's delta in the table, results.csv and results.json."""

import csv
import json

import pytest

from positronic.evaluate import evaluate, moving_average, table, write_outputs


def test_delta_is_the_answer_nll_minus_the_full_caches_in_table_csv_and_json(tiny, tmp_path, eval_text):
    report = evaluate(tiny, eval_text, policies=["streaming", "h2o"], budgets=[48], max_tokens=5, probe_filler=90,
                      probe_at=0.1)
    full = report.reference.probe
    assert full.nll == pytest.approx(-full.logprob) and full.delta == 0.0
    for run in report.runs:
        probe = run.probe
        assert probe.nll == pytest.approx(-sum(probe.logprobs)) and probe.full_nll == full.nll
        assert probe.delta == pytest.approx(probe.nll - full.nll, abs=1e-9) and abs(probe.delta) > 1e-6
    paths = write_outputs(report, tmp_path)
    rows = {r["policy"]: r for r in csv.DictReader(open(paths["csv"]))}
    for run in report.runs:
        row = rows[run.policy]
        assert float(row["probe_delta_nats"]) == pytest.approx(float(row["probe_nll"]) - float(row["probe_full_nll"]),
                                                               abs=2e-4)
        assert float(row["probe_delta_nats"]) == pytest.approx(run.probe.delta, abs=1e-4)
        assert row["probe_ranks"] == " ".join(map(str, run.probe.ranks)) and row["probe_fact_at"] == "10"
    data = json.loads(paths["json"].read_text())
    for run in data["runs"]:
        assert run["probe"]["delta"] == pytest.approx(run["probe"]["nll"] - data["reference"]["probe"]["nll"])
    cells = {c.header: list(c._cells) for c in table(report).columns}
    assert cells["Δ nats vs full"] == ["+0.00"] + [f"{r.probe.delta:+.2f}" for r in report.runs]
    assert cells["answer NLL"] == [f"{r.probe.nll:.2f}" for r in [report.reference] + report.runs]


def test_moving_average_is_trailing():
    assert moving_average([1, 2, 3, 4], 2) == ([2, 3, 4], [1.5, 2.5, 3.5])


def test_every_policy_in_a_plot_has_a_colour_of_its_own():
    """smartkv (the default) was drawn in matplotlib's next cycle colour, which another policy
    already had; every registered policy and one registered later now differ, and none is the
    full cache's black or the budget line's grey."""
    from positronic.evaluate.report import policy_colors
    from positronic.policies import POLICIES

    names = list(POLICIES) + ["smartkv", "a-later-policy"]
    colors = policy_colors(names)
    assert set(colors) == set(names)
    assert len(set(colors.values())) == len(colors)
    assert not {"black", "grey", "gray"} & set(colors.values())
