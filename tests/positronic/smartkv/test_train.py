"""Training (positronic/smartkv/train.py and __main__.py): `positronic smartkv train` writes gate
files that fit the model, and refuses bad options with one line and exit code 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from positronic.smartkv import GateSet

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.long
def test_train_command_writes_gates_that_fit_the_model(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    held = tmp_path / "b.txt"
    held.write_text("Pack my box with five dozen liquor jugs, said the sphinx. " * 10)
    out = tmp_path / "gates.safetensors"
    shared = tmp_path / "shared.safetensors"
    result = subprocess.run([sys.executable, "-m", "positronic.smartkv", "train", "--model", "random:tiny",
                             "--text", str(text), "--heldout", str(held), "--out", str(out), "--shared-out", str(shared),
                             "--window", "96", "--horizon", "32", "--hidden", "16", "--epochs", "2", "--threads", "1",
                             "--threshold", "1"],  # random weights attend near uniformly: a lower bar tells rows apart
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "held-out Spearman" in result.stdout and "mean" in result.stdout
    from positronic.models import load_model

    lm = load_model("random:tiny")
    for path, is_shared in ((out, False), (shared, True)):
        gates = GateSet.load(path)
        gates.check_model(lm.model.config)
        assert gates.shared == is_shared and len(gates.header["heldout_spearman"]) == 2
        assert gates.header["lifespan"] == {"horizon": 32, "threshold": 1.0, "window": 96}
    bad = subprocess.run([sys.executable, str(ROOT / "run.py"), "smartkv", "train", "--model", "random:tiny",
                          "--text", str(text), "--heldout", str(text), "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "held-out" in bad.stderr


@pytest.mark.long
def test_per_head_training_writes_a_gate_output_per_kv_head(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    held = tmp_path / "b.txt"
    held.write_text("Pack my box with five dozen liquor jugs, said the sphinx. " * 10)
    out, labels = tmp_path / "heads.safetensors", tmp_path / "labels.safetensors"
    common = ["-m", "positronic.smartkv", "train", "--model", "random:tiny", "--text", str(text), "--heldout", str(held),
              "--hidden", "16", "--epochs", "2", "--threads", "1"]
    rule = ["--window", "96", "--horizon", "32",
            "--threshold", "1.05"]  # a random model's attention is near uniform: 2x the share is never reached
    result = subprocess.run([sys.executable, *common, *rule, "--per-head", "--out", str(out), "--save-labels", str(labels)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    from positronic.models import load_model
    from positronic.smartkv.labels import LabelSet

    lm = load_model("random:tiny")
    gates = GateSet.load(out)
    gates.check_model(lm.model.config)
    assert gates.heads == lm.model.config.num_key_value_heads == 2 and gates.header["heads"] == 2
    saved = LabelSet.load(labels)
    assert saved.heads == 2 and saved.labels[0].shape == (saved.count, 2)
    assert not torch.equal(saved.labels[0][:, 0], saved.labels[0][:, 1]), "each kv head has its own lifespans"
    mixed = subprocess.run([sys.executable, *common, "--labels", str(labels), "--out", str(tmp_path / "g.safetensors")],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert mixed.returncode == 2 and "holds per-head lifespans; add --per-head" in mixed.stderr


@pytest.mark.long
def test_train_command_checks_its_files_before_loading_a_model(tmp_path):
    held = tmp_path / "b.txt"
    held.write_text("Pack my box with five dozen liquor jugs. " * 10)
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), "smartkv", "train", "--model", "no-such-model",
                             "--text", str(tmp_path / "missing.txt"), "--heldout", str(held),
                             "--out", str(tmp_path / "g.safetensors")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: cannot read") and "missing.txt" in result.stderr
    assert not (tmp_path / "g.safetensors").exists()


@pytest.mark.parametrize("args, message", [
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),  # wrote NaN gates, exit 0
    (["--lr", "0"], "--lr must be a finite number > 0, got 0"),
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),  # wrote untrained gates, exit 0
    (["--batch", "0"], "--batch must be >= 1, got 0"),  # ZeroDivisionError
    (["--threshold", "nan"], "--threshold must be a finite number in (0, window = 1024)"),  # accepted
    (["--threshold", "1024"], "--threshold must be a finite number in (0, window = 1024)"),  # no token ever used
    (["--horizon", "0"], "--horizon must be >= 1, got 0"),
    (["--window", "100", "--horizon", "99"], "--window 100 leaves no token with a whole horizon of 99"),
    (["--window", "4000"], "--window 4000 needs 3999 tokens of each text; a.txt holds at most"),
    (["--max-tokens", "100"], "--max-tokens 100 is fewer than the 1023 text tokens a --window of 1024 needs"),
    (["--hidden", str(2**63)], "--hidden must be in 1..4096"),
    (["--seed", "-1"], "--seed must be in 0..9223372036854775807, got -1"),
    (["--threads", "2147483648"], "--threads must be in 1..1024"),
    (["--threads", "0"], "--threads must be in 1..1024, got 0"),  # was taken as "not given"
    (["--epochs", "x"], "argument --epochs: invalid int value: 'x'"),  # argparse's own, on one line
    (["--labels", "/dev/zero"], "--labels /dev/zero: not a regular file (a character device)"),  # "does not exist"
    (["--labels", "FIFO"], "not a regular file (a FIFO)"),
    (["--labels", "a.txt"], "not a label file written by --save-labels"),
    (["--labels", "a.txt", "--window", "64"], "--labels brings the labels and the lifespan rule they were made with: "
                                              "leave out --window"),
    (["--shared-out", "shared.bin"], "--shared-out shared.bin must end in .safetensors"),
    (["--save-labels", "FIFO"], "--save-labels FIFO exists and is not a regular file"),
    (["--heldout", "DIR"], "cannot read --heldout DIR"),
])
def test_bad_options_are_refused_in_one_line_before_the_model_loads(args, message, tmp_path, monkeypatch, capsys,
                                                                    run_cli):
    monkeypatch.chdir(tmp_path)
    Path("a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 30)
    Path("b.txt").write_text("Pack my box with five dozen liquor jugs. " * 30)
    os.mkfifo("FIFO")
    Path("DIR").mkdir()
    before = sorted(os.listdir())
    code = run_cli("smartkv", "train", "--model", "no-such-model", "--text", "a.txt", "--heldout", "b.txt",
                   "--out", "g.safetensors", *args)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err and "no-such-model" not in err
    assert sorted(os.listdir()) == before


def test_a_training_that_diverges_writes_no_gates(tmp_path, capsys, run_cli):
    """--lr 1e30 is finite and passes the checks, and makes NaN weights: refused before any file
    is written (with --lr inf such gates were written, exit 0)."""
    text, held, out = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "g.safetensors"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    held.write_text("Pack my box with five dozen liquor jugs, said the sphinx. " * 5)
    torch_threads = torch.get_num_threads()
    try:
        code = run_cli("smartkv", "train", "--model", "random:tiny", "--text", str(text), "--heldout", str(held),
                       "--out", str(out), "--window", "40", "--horizon", "8", "--hidden", "8", "--depth", "2",
                       "--epochs", "2", "--batch", "64", "--threads", "1", "--lr", "1e30", "--threshold", "1")
    finally:
        torch.set_num_threads(torch_threads)
    err = capsys.readouterr().err
    assert code == 2 and "error: training diverged: the gates for --out hold NaN or infinite weights" in err
    assert not out.exists()


def test_labels_that_tell_no_token_from_another_are_refused_and_nothing_is_written(tmp_path, capsys, run_cli):
    """random:tiny attends near uniformly, so at the default threshold (2x a uniform share) no
    token is ever "used": every lifespan label is 0, there is nothing to learn and Spearman is
    undefined. Refused in one line naming the layers, exit 2, no gates and no label file (it
    printed a table of nan, exited 0 and wrote the gates)."""
    text, held = tmp_path / "a.txt", tmp_path / "b.txt"
    out, saved = tmp_path / "g.safetensors", tmp_path / "labels.safetensors"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    held.write_text("Pack my box with five dozen liquor jugs, said the sphinx. " * 5)
    torch_threads = torch.get_num_threads()
    try:
        code = run_cli("smartkv", "train", "--model", "random:tiny", "--text", str(text), "--heldout", str(held),
                       "--out", str(out), "--save-labels", str(saved), "--window", "40", "--horizon", "8",
                       "--hidden", "8", "--epochs", "1", "--threads", "1")
    finally:
        torch.set_num_threads(torch_threads)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]  # the rest: progress lines
    assert code == 2 and len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    assert errors[0].startswith("error: the training text: every token has the same lifespan label in layers 0, 1 (0)")
    assert not out.exists() and not saved.exists()
