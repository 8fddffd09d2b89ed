"""bench/tui_overhead.py stays runnable: plain and live tokens/s per model, their ratio and the
view's CPU share, and one frame's render time."""


def test_the_live_view_is_measured_against_plain_output(run_script):
    out = run_script("tui_overhead", "--models", "random:tiny", "--ticks", "30", "--budget", "48", "--repeats", "1",
                     check=True).stdout
    (row,) = [line.split() for line in out.splitlines() if line.strip().startswith("random:tiny ")
              and "%" in line and "pair" not in line]
    plain, live, ratio, cpu = float(row[1]), float(row[3]), float(row[5]), float(row[6].rstrip("%"))
    assert plain > 0 and live > 0 and abs(ratio - live / plain) < 0.01 and 0 < cpu < 100
    assert "one 120×40 frame at" in out
