"""bench/kv_cost.py stays runnable: a row per context and format, each 4-bit row's ratio to float."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kv_cost_bench_prints_ms_per_tick_per_format_and_the_ratio_to_float(run_script):
    out = run_script("kv_cost", "--model", "random:tiny",
                     "--contexts", "48", "--ticks", "3", "--rounds", "2", "--device", "cpu", "--unfused", check=True).stdout
    rows = {" ".join(line.split()[1:-3]): line.split() for line in out.splitlines() if line.startswith("     48")}
    assert list(rows) == ["float", "int4", "fp4", "int4h", "int4 unfused", "fp4 unfused"]
    float_ms = float(rows["float"][2])
    for label, row in rows.items():
        ms, ratio, per_token = float(row[-3]), float(row[-2].rstrip("x")), int(row[-1])
        assert ms > 0 and abs(ratio - ms / float_ms) < 0.01 * ratio
        # random:tiny: 2 layers, 2 kv heads, head_dim 16; int4h: one group per row, and the row's position
        assert per_token == {"float": 512, "int4h": 96}.get(label, 80)
