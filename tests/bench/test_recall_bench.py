"""bench/recall.py stays runnable: a tiny probe prints a row per policy, Δ = answer NLL - the full cache's."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_recall_bench_prints_every_policy_against_the_full_cache(tmp_path, run_script):
    text = tmp_path / "t.txt"
    text.write_text("The keeper of the lighthouse wrote in his log every evening. " * 8)
    out = run_script("recall", str(text), "--model", "random:tiny",
                     "--budget", "48", "--filler", "20", "--at", "0.5", check=True).stdout
    assert "fact at stream index 11" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("full", "streaming", "scored", "h2o", "brightness",
                                                    "brightness+recall")}
    assert list(rows) == ["full", "streaming", "scored", "h2o", "brightness", "brightness+recall"]
    full = float(rows["full"][1])
    for name, row in rows.items():
        nll, delta = float(row[1]), float(row[2])
        assert abs(delta - (nll - full)) <= 0.011, row
        assert len(row) == 3 + 4 + 2 and row[-2] in ("yes", "no"), row  # 4 ranks, recalled, ms/tok
    refused = run_script("recall", "--model", "random:tiny",
                         "--budget", "48", "--filler", "600")
    assert refused.returncode == 2 and "512 positions" in refused.stderr


def test_policy_names_take_their_marks_and_the_reference_can_be_left_out(tmp_path, bench_script, run_script):
    script = bench_script("recall")
    both = script.policy_config("smartkv+recall+recent", 256, 4)
    assert (both.policy, both.recall, both.memory_rank) == ("smartkv", True, "recent")
    plain = script.policy_config("brightness+recall", 256, 4)
    assert (plain.policy, plain.recall, plain.memory_rank) == ("brightness", True, "gates")
    with pytest.raises(script.EvalError, match="unknown mark often"):
        script.policy_config("smartkv+often", 256, 4)
    text = tmp_path / "t.txt"
    text.write_text("The keeper of the lighthouse wrote in his log every evening. " * 8)
    out = run_script("recall", str(text), "--model", "random:tiny",
                     "--budget", "48", "--filler", "20", "--at", "0.5", "--policies", "streaming",
                     "--no-reference", check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["full"], ["streaming"])]
    assert len(rows) == 1 and rows[0][0] == "streaming" and rows[0][2] == "-"
