"""bench/kv_formats.py stays runnable: bytes per token, round-trip and re-rotation errors."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kv_formats_bench_prints_bytes_errors_and_rerotation_costs(run_script):
    out = run_script("kv_formats", "--model", "random:tiny",
                     "--shapes", "random:tiny", "random:tinyllama", "--tokens", "40", "--rotations", "1", "2", check=True).stdout
    lines = [line.split() for line in out.splitlines() if line.split()]
    first = {}
    for cells in lines:
        first.setdefault(cells[0], cells)
    # random:tiny: 2 layers, 2 kv heads, head_dim 16 -> 4-bit rows of 8 + 2 bytes
    assert first["random:tiny"][1:5] == ["512", "256", "80", "80"]
    assert first["random:tinyllama"][1:5] == ["45056", "22528", "5984", "5984"]
    assert ["random:tiny", "buffers", "(float32)", "512", "-", "80", "80"] in lines, "the buffers hold what the formula says"
    bounds = {(c[0], c[1]): float(c[2]) for c in lines if c[0] in ("int4", "fp4") and len(c) == 5}
    assert all(bounds[(name, "1")] <= 3 and bounds[(name, "2")] <= 7 for name in ("int4", "fp4"))
    assert "re-rotating 40 keys x 2 layers, fp4" in out
