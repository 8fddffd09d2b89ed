"""bench/invariance.py stays runnable and can tell: a module whose row depends on the other rows
is named, and a CPU model in float32 (RowInvariantLinear) has none."""

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import invariance  # noqa: E402


def test_a_cpu_model_in_float32_gives_every_row_its_bits_alone_in_every_module():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "invariance.py"), "--model", "random:tiny",
                          "--rows", "4"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line.split() for line in run.stdout.splitlines()]
    table = [line for line in lines if len(line) == 6 and line[2] == "4"]  # a module's row: kind, shape, rows, ...
    kinds = {line[0] for line in table}
    assert {"Embedding", "LlamaRMSNorm", "RowInvariantLinear"} <= kinds
    attention = next(line for line in lines if line[:2] == ["attention", "function"])
    assert attention[2:] == ["positronic_sdpa", "4", "1", "0", "0"]
    # random:tiny's 2 layers and head: 5 norms, 15 linear layers, 2 activations, the embedding
    assert sum(int(line[3]) for line in table) == 23
    assert all(line[4] == "0" for line in table)
    assert "every row: the same bits alone as among the others" in run.stdout


def test_a_module_that_mixes_rows_is_found_with_how_far_they_moved():
    torch.manual_seed(0)
    packed = torch.randn(1, 5, 16)
    differing, largest = invariance.row_differences(nn.Softmax(dim=1), packed)  # across the rows: each depends on all
    assert differing == 5 and largest > 0.01
    assert invariance.row_differences(nn.Softmax(dim=-1), packed) == (0, 0.0)  # within a row


def test_one_row_is_refused_with_the_reason():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "invariance.py"), "--rows", "1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--rows: at least 2" in run.stderr
