"""bench/decode.py stays runnable: a tiny run prints every row with its ratios and shares."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_bench_prints_the_table_for_every_run():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), "--model", "random:tiny", "--contexts",
                          "64", "--ticks", "8", "--repeats", "1", "--batches", "1", "4"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    lines = [line for line in out.splitlines() if line.strip().startswith("64 ")]
    names = ["(a) hf-generate (sdpa)", "(b) loop, maintenance off", "(c) maintenance on, batch 1",
             "(c) maintenance on, batch 4"]
    assert len(lines) == len(names) and all(name in line for name, line in zip(names, lines))
    rows = [line.split() for line in lines]
    for row in rows:
        assert any(cell.endswith("x") for cell in row), row  # the ratio against generate
    maintained = rows[2]
    shares = [cell for cell in maintained if cell.endswith("%")]
    assert len(shares) == 2 and all(0 <= float(s[:-1]) <= 100 for s in shares)
