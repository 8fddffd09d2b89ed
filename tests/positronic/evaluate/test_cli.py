"""`positronic eval` (positronic.evaluate.cli): the table and files, bad flags in one line."""

import json

import pytest

from positronic.evaluate import DEFAULT_TEXT


def test_cli_eval_writes_table_csv_json_png(tmp_path, capsys, eval_text, run_cli):
    text = tmp_path / "t.txt"
    text.write_text(eval_text)
    out = tmp_path / "res"
    assert run_cli("eval", "--model", "random:tiny", "--text", str(text), "--budget", "48", "--budget", "56",
                   "--policy", "h2o", "--max-tokens", "70", "--probe-filler", "30", "--out", str(out)) == 0
    stdout = capsys.readouterr().out
    assert "h2o" in stdout and "full" in stdout and "answer NLL" in stdout and "Δ nats vs full" in stdout
    data = json.loads((out / "results.json").read_text())
    assert [run["label"] for run in data["runs"]] == ["h2o@48", "h2o@56"] and data["reference"]["label"] == "none@full"
    assert {p.name for p in out.iterdir()} == {"results.csv", "results.json", "nll_by_position.png"}
    assert DEFAULT_TEXT.is_file()


def test_evict_every_sets_the_shared_row_policies_and_leaves_the_others(tmp_path, capsys, eval_text, run_cli):
    """In a sweep of several policies --evict-every reaches those that take it (as --gates reaches
    smartkv alone): h2o edits 7 rows every 7 ticks (its own batch at 48 is 4: 44 deletes here),
    none keeps its shift, and the files say N."""
    text = tmp_path / "t.txt"
    text.write_text(eval_text)
    out = tmp_path / "res"
    assert run_cli("eval", "--model", "random:tiny", "--text", str(text), "--budget", "48", "--policy", "h2o",
                   "--policy", "none", "--evict-every", "7", "--max-tokens", "90", "--no-probe", "--out", str(out)) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["evict_every"] == 7
    runs = {run["label"]: run for run in data["runs"]}
    assert runs["h2o@48"]["deletes"] % 7 == 0 and runs["h2o@48"]["deletes"] > 0
    assert runs["none@48"]["deletes"] > 0


def test_an_eval_without_policy_runs_the_products_default_beside_the_sweep():
    """The policy `run` and `serve` pick is in every default eval: SmartKV with recall (ranked by
    recent use) where gates ship for the model, recall on for it alone; brightness, already in
    the sweep, elsewhere; a budget SmartKV cannot run with falls back to it as `run` does."""
    from positronic.brain.config import BrainConfig
    from positronic.evaluate.cli import default_sweep
    from positronic.evaluate.stream import RunSettings, make_config
    from positronic.evaluate.sweep import DEFAULT_POLICIES

    policies, recalled, gates = default_sweep("smollm2", 128, RunSettings())
    assert policies == [*DEFAULT_POLICIES, "smartkv"] and recalled == ("smartkv",) and gates == ""
    config = make_config("smartkv", 128, recall=True)
    assert (config.recall, config.memory_rank) == (True, BrainConfig(policy="smartkv", recall=True).memory_rank)
    assert config.reread and not make_config("smartkv", 128, recall=True, reread=False).reread
    assert not make_config("smartkv", 128, reread=True).reread, "reread goes to smartkv with recall alone"
    assert not make_config("brightness", 128, recall=True, reread=True).reread
    assert default_sweep("random:tiny", 128, RunSettings()) == (list(DEFAULT_POLICIES), (), "")
    assert default_sweep("smollm2", 8, RunSettings()) == (list(DEFAULT_POLICIES), (), "")
    assert default_sweep("Qwen/Qwen3-0.6B", 128, RunSettings()) == ([*DEFAULT_POLICIES, "smartkv"], ("smartkv",), "auto"), \
        "a model without shipped gates: SmartKV on gates trained on its first use, as `run` picks"


@pytest.mark.parametrize("args,message", [
    (["--policy", "lru"], "unknown policy 'lru'"),
    (["--text", "/nonexistent/x.txt"], "cannot read --text /nonexistent/x.txt"),
    (["--text", "/dev/zero"], "cannot read --text /dev/zero: more than the 67108864 bytes read"),  # not without bound
    (["--budget", "20"], "budget 20"),
    (["--max-tokens", "1"], "--max-tokens must be >= 2"),
    (["--probe-at", "1.5"], "--probe-at must be a fraction in 0..1, got 1.5"),
    (["--probe-filler", "-1"], "--probe-filler must be >= 0"),
    (["--budget", "48", "--probe-filler", "600"], "above random:tiny's 512 positions: --probe-filler can be at most"),
    (["--generate", "8", "--recall"], "--recall applies to the teacher-forced eval"),
    (["--repairer", "oracle"], "unknown repairer 'oracle'"),
    # issue 75: accepted and never used, or refused only after the model had loaded
    (["--memory-rank", "bogus"], "--memory-rank must be one of gates, recent, got 'bogus'"),
    (["--policy", "h2o", "--gates", "x"], "--gates applies to policy smartkv, which is not among the --policy runs"),
    (["--gates", "x"], "--gates x does not exist"),  # without --policy the gates make smartkv the default, as in run
    (["--policy", "h2o", "--memory-rank", "gates"], "--memory-rank applies to policy smartkv"),
    (["--policy", "h2o", "--reread"], "--reread applies to policy smartkv, which is not among the --policy runs"),
    (["--policy", "h2o", "--no-reread"], "--no-reread applies to policy smartkv"),
    (["--generate", "8", "--no-reread"], "--reread applies to the teacher-forced eval"),
    (["--policy", "none", "--recall"], "--recall adds runs with recall of the policies that evict"),
    (["--kv-store", "ring"], "the ring store serves only the streaming policy, not brightness (choose --policy "
                             "streaming or --kv-store splice)"),
    (["--policy", "none", "--evict-every", "4"], "--evict-every applies to the shared-row policies"),
    (["--policy", "h2o", "--budget", "64", "--evict-every", "50"],
     "--evict-every 50 frees more rows at once than policy h2o can take at budget 64"),
    (["--kv-format", "int3"], "--kv-format: unknown kv format 'int3'"),
    (["--budget", str(2**64 - 1)], "--budget must be in -2**63..2**63-1"),
    (["--segments", "0"], "--segments must be >= 1, got 0"),
    (["--probe-filler", str(2**63)], f"--probe-filler {2**63} is more tokens than any tokenizer makes"),
    (["-t", "2147483648"], "Invalid value for '-t' / '--threads'"),
    (["--prompt-tokens", "64"], "--prompt-tokens applies to --generate"),
    (["--seed", "1"], "--seed applies to --generate"),
    (["--no-probe", "--probe-at", "0.5"], "--probe-at applies to the retrieval probe (leave out --no-probe)"),
    (["--generate", "8", "--max-tokens", "64", "--smooth", "4"],
     "--max-tokens, --smooth apply to the teacher-forced eval, not to --generate"),
    (["--generate", "8", "--gates", "g.safetensors"], "--gates applies to the teacher-forced eval"),
    (["--generate", "8", "--seed", "-1"], "--seed must be in 0..2**63-1, got -1"),
    (["--generate", "8", "--kv-store", "heap"], "--kv-store must be one of splice, ring, got 'heap'"),
    # refused before anything runs (here the full-cache reference would run first)
    (["--repairer", "mlm:/nonexistent", "--budget", "48", "--max-tokens", "50", "--no-probe"],
     "masked LM directory '/nonexistent' does not exist"),
])
def test_cli_eval_bad_flags_give_one_line_and_exit_code_2(args, message, capsys, run_cli, tmp_path):
    assert run_cli("eval", "--model", "random:tiny", "--out", str(tmp_path / "out"), *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_an_unusable_out_is_refused_before_the_model_loads(tmp_path, capsys, run_cli):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert run_cli("eval", "--model", "no-such-model", "--out", str(blocker / "results")) == 2
    err = capsys.readouterr().err
    assert "cannot use --out" in err and "no-such-model" not in err


def test_cli_eval_recall_and_probe_at(tmp_path, capsys, eval_text, run_cli):
    text = tmp_path / "t.txt"
    text.write_text(eval_text)
    out = tmp_path / "res"
    assert run_cli("eval", "--model", "random:tiny", "--text", str(text), "--budget", "48", "--policy", "h2o",
                   "--max-tokens", "5", "--probe-filler", "40", "--probe-at", "0.5", "--recall", "--out", str(out)) == 0
    assert "h2o+recall" in capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert [run["label"] for run in data["runs"]] == ["h2o@48", "h2o+recall@48"]
    assert data["settings"]["probe_at"] == 0.5 and data["runs"][1]["probe"]["fact_at"] == 21
