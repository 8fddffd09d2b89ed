"""bench/observed_rank.py (a prototype that patches SmartKV's rank while another bench script
runs) stays runnable, is neutral at beta 0, and changes the rows kept when it weighs in."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TASK = ["--model", "random:tiny", "--text", str(ROOT / "texts" / "alice_ch1-2.txt"), "--offset", "0", "--tokens", "128",
        "--budgets", "0.5", "--methods", "smartkv+recall", "--threads", "1"]


def perplexity(done) -> float:
    return float(re.search(r"^smartkv\+recall\s+budget\s+\S+\s+ppl\s+([\d.]+)", done.stdout, re.MULTILINE).group(1))


def test_the_prototype_is_neutral_at_beta_0_and_changes_the_rows_kept_at_beta_2(run_script, monkeypatch, tiny, tmp_path):
    """On random:tiny with random per-head gates (the embedded model's shipped gates give the same
    verdicts, in ten times the time)."""
    from positronic.smartkv import GateSet, policy, rows

    for owner, name in ((rows.Memories, "_ranks"), (rows.Memories, "take_back"), (rows.Memories, "offer"),
                        (policy.SmartKVPolicy, "_plan"), (policy.SmartKVPolicy, "recall_span")):
        monkeypatch.setattr(owner, name, owner.__dict__[name])  # the prototype patches them: put back at teardown
    gates = tmp_path / "gates.safetensors"
    GateSet.for_config(tiny.model.config, seed=3, per_head=True, header={"lifespan": {"horizon": 48}}).save(gates)
    task = [*TASK, "--gates", str(gates)]
    plain = perplexity(run_script("smartkv", *task, check=True))
    assert perplexity(run_script("observed_rank", "--beta", "0", "--", "smartkv", *task, check=True)) == plain
    assert perplexity(run_script("observed_rank", "--beta", "2", "--", "smartkv", *task, check=True)) != plain


def test_it_names_what_it_needs(monkeypatch, bench_script, run_script):
    done = run_script("observed_rank", "--beta", "2")
    assert done.returncode != 0 and "usage" in done.stderr
    # the other refusals with the patch itself replaced: nothing may be patched when a flag is refused
    script = bench_script("observed_rank")
    monkeypatch.setattr(script, "patch", lambda *args: pytest.fail(f"let through: {args}"))  # nothing patched
    for flags, says in ((["--decay", "1.5"], "--decay in (0, 1)"), (["--protect", "1"], "--protect "),
                        (["--span", "-1"], "--span "), ([], "name the script")):
        with pytest.raises(SystemExit) as refused:
            script.main([*flags, "--", *(["smartkv"] if flags else [])])
        assert says in str(refused.value.code)
