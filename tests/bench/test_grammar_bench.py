"""bench/grammar.py stays runnable: llguidance's row (xgrammar's where installed) and a
grammar's cost to a tick, in the table and the JSON."""

import json

import pytest


def test_it_measures_the_library_and_the_tick(run_script, tmp_path):
    pytest.importorskip("llguidance")
    out = run_script("grammar", "--model", "random:tiny", "--repeats", "1", "--ticks", "3",
                     "--json", str(tmp_path / "g.json"), check=True).stdout
    assert "llguidance" in out and "a greedy tick:" in out
    saved = json.loads((tmp_path / "g.json").read_text())
    row = saved["libraries"][0]
    assert row["library"].startswith("llguidance") and 0 < row["mask_ms"] < 1000 and row["compile_ms"] > 0
    assert saved["tick_ms_constrained"] > 0 and saved["tick_ms_free"] > 0
