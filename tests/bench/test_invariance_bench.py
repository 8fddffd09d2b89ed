"""bench/invariance.py stays runnable and can tell: a module whose row depends on the other rows
is named, and a CPU model in float32 (RowInvariantLinear) has none."""

import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import invariance  # noqa: E402


def test_a_cpu_model_in_float32_gives_every_row_its_bits_alone_in_every_module(run_script):
    run = run_script("invariance", "--model", "random:tiny",
                     "--rows", "4")
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


def test_one_row_is_refused_with_the_reason(run_script):
    run = run_script("invariance", "--rows", "1")
    assert run.returncode == 2 and "--rows: at least 2" in run.stderr


def test_a_tiled_layer_is_checked_as_the_model_runs_it_and_untiled_beside_it():
    """On a GPU the loader tiles half-precision layers; one run must show the tiled layer (what
    counts) and its own forward untiled (the cause it removes, never a finding)."""
    from positronic.models import load_model
    from positronic.models.tiles import use_row_tiles

    lm = load_model("random:tiny", dtype="float32")
    assert use_row_tiles(lm.model) == 5  # the norms (the linear layers are RowInvariantLinear here)
    lines = {(kind, runs): (count, bad) for kind, shape, count, bad, largest, runs in invariance.check(lm, 4)}
    assert lines[("TiledLlamaRMSNorm", True)][0] == lines[("LlamaRMSNorm(untiled)", False)][0] == 5
    assert lines[("TiledLlamaRMSNorm", True)][1] == 0
    assert ("LlamaRMSNorm", True) not in lines
