"""bench/smartkv.py stays runnable: a perplexity row per method and budget, and --where's per-token
differences add up to the two perplexities."""

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_smartkv_bench_reports_perplexities_and_where_one_method_loses_to_another(run_script):
    out = run_script("smartkv", "--model", "random:tiny",
                     "--text", str(ROOT / "texts" / "alice_ch1-2.txt"), "--offset", "0", "--tokens", "128",
                     "--budgets", "0.5", "--methods", "streaming", "smartkv-random",
                     "--where", "smartkv-random", "streaming", check=True).stdout
    ppl = {m.group(1): float(m.group(2))
           for m in re.finditer(r"^(\S+)\s+budget\s+\S+\s+ppl\s+([\d.]+)", out, re.MULTILINE)}
    assert set(ppl) == {"full", "streaming", "smartkv-random"}
    total = re.search(r"NLL of smartkv-random minus streaming, budget 64: ([+-][\d.]+) nats over 128 tokens", out)
    assert total, out
    assert float(total.group(1)) == pytest.approx(
        128 * (math.log(ppl["smartkv-random"]) - math.log(ppl["streaming"])), abs=0.05)
    per_block = re.search(r"per 128 tokens: (.+)", out).group(1).split()
    assert len(per_block) == 1 and float(per_block[0]) == pytest.approx(float(total.group(1)), abs=0.01)
    assert len(re.findall(r"^  token\s+\d+\s+[+-]", out, re.MULTILINE)) == 12


@pytest.mark.parametrize("extra, message", [
    (["--methods", "streming"], "unknown method 'streming'"),
    (["--methods", "streaming", "--where", "smartkv-random", "streaming"], "add smartkv-random to --methods"),
    (["--where", "smartkv", "streaming"], "--where smartkv: no such gates for random:tiny"),
    (["--kv-format", "int4h", "--methods", "smartkv-random"], "(not smartkv-random: SmartKVCache keeps float rows)"),
    (["--kv-format", "int4", "--methods", "streaming", "--where", "streaming", "full"], "--where compares float runs"),
])
def test_smartkv_bench_refuses_a_bad_method_with_one_line_before_running(extra, message, run_script):
    run = run_script("smartkv", "--model", "random:tiny",
                     "--text", str(ROOT / "texts" / "alice_ch1-2.txt"), "--offset", "0", "--tokens", "128",
                     "--budgets", "0.5", *extra)
    assert run.returncode != 0 and message in run.stderr
    assert "Traceback" not in run.stderr and "budget" not in run.stdout  # nothing ran


def test_an_out_run_adds_its_rows_and_keeps_the_others_only_if_they_scored_the_same_tokens(tmp_path, run_script):
    """bench/smartkv.py --out with --methods adds to the file; rows written before rows recorded
    their offset are kept when the file's full cache has this run's perplexity, else replaced."""
    import json

    path = tmp_path / "smartkv_alice_ch1-2.json"
    run = ["--model", "random:tiny", "--text", str(ROOT / "texts" / "alice_ch1-2.txt"), "--offset", "0", "--tokens",
           "128", "--budgets", "0.5", "--out", str(tmp_path), "--methods"]
    run_script("smartkv", *run, "streaming", check=True)
    data = json.loads(path.read_text())
    for row in data["rows"]:  # as a file written before 2026-11-29
        del row["offset"], row["nll"]
    path.write_text(json.dumps(data))
    run_script("smartkv", *run, "smartkv-random", check=True)
    rows = json.loads(path.read_text())["rows"]
    assert sorted((row["method"], "nll" in row) for row in rows) == [
        ("full", True), ("smartkv-random", True), ("streaming", False)]

    data = json.loads(path.read_text())
    for row in data["rows"]:
        row.pop("offset", None)
        if row["method"] == "full":
            row["ppl"] *= 1.01  # another text's full cache
    path.write_text(json.dumps(data))
    out = run_script("smartkv", *run, "smartkv-random", check=True).stdout
    assert "its rows scored other tokens" in out
    assert sorted(row["method"] for row in json.loads(path.read_text())["rows"]) == ["full", "smartkv-random"]


def test_an_out_run_records_its_cpu_kernels_and_refuses_a_file_of_rows_run_with_others(tmp_path, run_script):
    """The same run rounds differently under other CPU kernels (bench/cpu_kernels.py), so every row
    records them, and rows of two kernels are not put in one file: refused before anything runs,
    the file unchanged."""
    import json

    path = tmp_path / "smartkv_alice_ch1-2.json"
    run = ["--model", "random:tiny", "--text", str(ROOT / "texts" / "alice_ch1-2.txt"), "--offset", "0", "--tokens",
           "128", "--budgets", "0.5", "--out", str(tmp_path), "--methods", "streaming"]
    run_script("smartkv", *run, check=True)
    data = json.loads(path.read_text())
    import torch
    assert {row["kernels"]["cpu"] for row in data["rows"]} == {torch.backends.cpu.get_cpu_capability()}

    data["rows"][0]["kernels"] = {"cpu": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}  # as if run on another CPU
    path.write_text(json.dumps(data))
    before = path.read_text()
    refused = run_script("smartkv", *run)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "its full row was run with kernels AVX2 (ONEDNN_MAX_CPU_ISA=AVX2)" in refused.stderr
    assert "give another --out" in refused.stderr and "budget" not in refused.stdout  # nothing ran
    assert path.read_text() == before


def test_a_kv_format_runs_the_brains_methods_on_its_rows_under_their_own_names(run_script):
    def run(*extra) -> str:
        return run_script("smartkv", "--model", "random:tiny",
                          "--text", str(ROOT / "texts" / "alice_ch1-2.txt"), "--offset", "0", "--tokens", "128",
                          "--budgets", "0.5", "--methods", "streaming", *extra, check=True).stdout

    packed, plain = run("--kv-format", "int4"), run()
    found = re.search(r"^streaming@int4\s+budget\s+64\s+ppl\s+([\d.]+)", packed, re.MULTILINE)
    assert found, packed
    assert not re.search(r"^streaming\s+budget", packed, re.MULTILINE), "the float row is not run"
    float_ppl = re.search(r"^streaming\s+budget\s+64\s+ppl\s+([\d.]+)", plain, re.MULTILINE).group(1)
    assert found.group(1) != float_ppl, "the int4 row is run on int4 rows"
