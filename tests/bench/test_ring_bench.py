"""bench/ring.py stays runnable: a row per model and context, the ring moving no row."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ring_bench_prints_ms_per_tick_for_both_stores_and_their_ratio(run_script):
    out = run_script("ring", "--models", "random:tiny",
                     "--contexts", "48", "64", "--ticks", "4", "--rounds", "2", check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("random:tiny")]
    assert [row[1] for row in rows] == ["48", "64"]
    for row in rows:
        splice, ring, ratio = float(row[2]), float(row[3]), float(row[4])
        assert splice > 0 and ring > 0
        # the times are printed to 0.01 ms and the ratio from the unrounded ones: at ~1 ms a tick
        # the rounding alone moves ring / splice by up to ~1%
        slack = ratio * (0.005 / splice + 0.005 / ring) + 0.0005
        assert abs(ratio - ring / splice) <= slack
        assert row[7] == "0", "evictions move no ring row"
        assert row[9] == "8", "2 rounds x 4 ticks per store"
