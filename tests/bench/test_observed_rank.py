"""bench/observed_rank.py (a prototype that patches SmartKV's rank while another bench script
runs) stays runnable, is neutral at beta 0, and changes the rows kept when it weighs in."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "bench" / "observed_rank.py")
TASK = ["--text", str(ROOT / "texts" / "alice_ch1-2.txt"), "--offset", "0", "--tokens", "128", "--budgets", "0.5",
        "--methods", "smartkv+recall", "--threads", "1"]


def perplexity(args: list[str]) -> float:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, check=True).stdout
    return float(re.search(r"^smartkv\+recall\s+budget\s+\S+\s+ppl\s+([\d.]+)", out, re.MULTILINE).group(1))


@pytest.mark.smollm2  # bench/smartkv.py runs the embedded model (no `smol` fixture marks it)
def test_the_prototype_is_neutral_at_beta_0_and_changes_the_rows_kept_at_beta_2():
    plain = perplexity([str(ROOT / "bench" / "smartkv.py"), *TASK])
    assert perplexity([SCRIPT, "--beta", "0", "--", "smartkv", *TASK]) == plain
    assert perplexity([SCRIPT, "--beta", "2", "--", "smartkv", *TASK]) != plain


def test_it_names_what_it_needs(monkeypatch, bench_script):
    done = subprocess.run([sys.executable, SCRIPT, "--beta", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "usage" in done.stderr
    # the other refusals in this process (a subprocess each was ~4 s of torch import here, 16 on a GPU host)
    script = bench_script("observed_rank")
    monkeypatch.setattr(script, "patch", lambda *args: pytest.fail(f"let through: {args}"))  # nothing patched
    for flags, says in ((["--decay", "1.5"], "--decay in (0, 1)"), (["--protect", "1"], "--protect "),
                        (["--span", "-1"], "--span "), ([], "name the script")):
        with pytest.raises(SystemExit) as refused:
            script.main([*flags, "--", *(["smartkv"] if flags else [])])
        assert says in str(refused.value.code)
