"""bench/rounds.py stays runnable: a tiny run prints a row per policy and size, Core v4's
rounds against today's batch, with the share of equal tokens."""


def test_rounds_bench_prints_a_row_per_policy_and_size(run_script):
    out = run_script("rounds", "--model", "random:tiny", "--budget", "48", "--sizes", "1", "3",
                     "--ticks", "4", "--repeats", "1", "--policies", "streaming", "h2o", check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["streaming"], ["h2o"])]
    assert [(row[0], row[1]) for row in rows] == [("streaming", "1"), ("streaming", "3"), ("h2o", "1"), ("h2o", "3")]
    for row in rows:
        batch_ms, core_ms, forward_ms, outside_ms = map(float, row[2:6])
        assert batch_ms > 0 and core_ms > forward_ms > 0 and outside_ms > 0 and int(row[-3]) > 0  # ops a round
        assert row[-2] == "100.0%"  # greedy tokens of the two equal on the CPU in float32
        assert row[-1] == ("-" if row[1] == "1" else "100%")  # every sequence batched makes its alone tokens


def test_rounds_bench_compiled_prints_the_same_rows_without_an_op_count(run_script):
    """--compiled: the engine's forward one graph (compiled before the clock runs); its ops are
    not counted (under a counter the round runs eagerly), the tokens still equal."""
    out = run_script("rounds", "--model", "random:tiny", "--budget", "48", "--sizes", "1", "3",
                     "--ticks", "4", "--repeats", "1", "--policies", "h2o", "--compiled", check=True).stdout
    assert "core v4 compiled" in out.splitlines()[0]
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["h2o"]]
    assert [row[1] for row in rows] == ["1", "3"]
    assert all(row[-3] == "-" and row[-2] == "100.0%" for row in rows) and rows[1][-1] == "100%"


def test_rounds_bench_runs_a_weight_format_and_the_loop_without_the_tiles(run_script):
    """--weights picks the linear layers' format; --no-tiles (int8-weight-only) sums every
    product by the one-row loop, and the header says both."""
    out = run_script("rounds", "--model", "random:tiny", "--budget", "48", "--sizes", "4", "--ticks", "3",
                     "--repeats", "1", "--policies", "h2o", "--weights", "int8-weight-only", "--no-tiles",
                     check=True).stdout
    assert "weights int8-weight-only (no tiles)" in out.splitlines()[0]
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["h2o"]]
    assert [row[1] for row in rows] == ["4"] and rows[0][-1] == "100%"


def test_rounds_bench_refuses_no_tiles_without_int8_weight_only(run_script):
    result = run_script("rounds", "--model", "random:tiny", "--no-tiles")
    assert result.returncode == 2 and "--no-tiles is for --weights int8-weight-only" in result.stderr
