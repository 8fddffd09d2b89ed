"""bench/long_run.py stays runnable: a run of the default command, then its text re-scored,
distinct-4, rebuilds and live length per chunk of ticks."""

import json


def test_it_runs_the_command_and_judges_each_chunk(run_script, tmp_path):
    out = run_script("long_run", "--model", "random:tiny", "--ticks", "40", "--budget", "48", "--every", "20",
                     "--context", "16", "--out", str(tmp_path), check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1-20"], ["21-40"])]
    assert [row[0] for row in rows] == ["1-20", "21-40"]
    for row in rows:
        assert float(row[1]) > 1 and 0 < float(row[2]) <= 1 and row[3] == "0" and int(row[4]) <= 48
    saved = json.loads((tmp_path / "long_run.json").read_text())
    assert [row["ticks"] for row in saved["rows"]] == ["1-20", "21-40"] and "--no-input" in saved["command"]


def test_bad_chunking_is_refused(run_script, tmp_path):
    done = run_script("long_run", "--ticks", "10", "--every", "20", "--out", str(tmp_path))
    assert done.returncode == 2 and "--every must be >= 1 and <= --ticks" in done.stderr
