"""bench/graph.py (issue 70's figures) stays runnable: a tiny CPU run prints a row per B, the
compiled round against the eager one and HF generate, batched = alone, the recapture count of a
run with joins and leaves, and writes the JSON bench/gpu.sh copies to bench/results/gpu.json."""

import json


def test_graph_bench_writes_the_figures_gpu_json_names(run_script, tmp_path):
    out = run_script("graph", "--model", "random:tiny", "--budget", "48", "--sizes", "1", "4", "--ticks", "4",
                     "--long", "40", "--json", str(tmp_path / "gpu.json"), check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["4"])]
    assert [row[0] for row in rows] == ["1", "4"] and all(float(row[1]) > 0 for row in rows)
    assert "batched = alone at B = 4: 3 of 3 sequences" in out
    figures = json.loads((tmp_path / "gpu.json").read_text())
    assert {"date", "gpu", "model", "dtype", "b1_ms_per_token", "hf_generate_ms_per_token", "b64_tok_s",
            "batched_equal_alone", "recaptures"} <= set(figures)
    assert figures["gpu"] == "cpu" and figures["b64_tok_s"] is None and figures["batched_equal_alone"] == "3/3"
    assert figures["recaptures"] == 0 and figures["long_run"]["recompiles"] == 0
    assert figures["long_run"]["joins"] > 0 and figures["long_run"]["leaves"] > 0 and figures["complete"]
    assert figures["b1_ms_per_token"] > 0 and figures["hf_generate_ms_per_token"] > 0
