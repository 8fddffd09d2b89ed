"""Training (positronic/smartkv/train.py and __main__.py): `positronic smartkv train` writes gate
files that fit the model, and refuses bad options with one line and exit code 2."""

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
                             "--window", "96", "--horizon", "32", "--hidden", "16", "--epochs", "2", "--threads", "1"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "held-out Spearman" in result.stdout and "mean" in result.stdout
    from positronic.models import load_model

    lm = load_model("random:tiny")
    for path, is_shared in ((out, False), (shared, True)):
        gates = GateSet.load(path)
        gates.check_model(lm.model.config)
        assert gates.shared == is_shared and len(gates.header["heldout_spearman"]) == 2
        assert gates.header["lifespan"] == {"horizon": 32, "threshold": 2.0, "window": 96}
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
              "--window", "96", "--horizon", "32", "--hidden", "16", "--epochs", "2", "--threads", "1",
              "--threshold", "1.05"]  # a random model's attention is near uniform: 2x the share is never reached
    result = subprocess.run([sys.executable, *common, "--per-head", "--out", str(out), "--save-labels", str(labels)],
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
