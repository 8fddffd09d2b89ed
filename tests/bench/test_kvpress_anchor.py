"""bench/kvpress_anchor.py (run in bench/.kvpress-venv, not here): what runs without kvpress."""

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.kvpress_anchor import refuse_other_kernels, run_path  # noqa: E402

HERE = {"cpu": "AVX512"}


def test_a_run_made_with_other_cpu_kernels_is_not_reused_into_this_table(tmp_path):
    """An existing JSON is reused unless --force; one that recorded other CPU kernels would mix two
    kernels' numbers in one table (bench/cpu_kernels.py), so the run stops before anything runs,
    naming the file, both kernels and the way out; runs of the same kernels or none go ahead."""
    args = argparse.Namespace(texts=["dracula"], out=tmp_path, tokens=1024, budgets=[0.125, 0.25])
    presses = ["full", "snapkv"]
    run_path(tmp_path, "dracula", 1024, None, "full").write_text(json.dumps({"ppl": 29.33}))  # before the record
    run_path(tmp_path, "dracula", 1024, 128, "snapkv").write_text(json.dumps({"ppl": 29.99, "kernels": HERE}))
    refuse_other_kernels(args, presses, HERE)

    other = {"cpu": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    path = run_path(tmp_path, "dracula", 1024, 256, "snapkv")
    path.write_text(json.dumps({"ppl": 29.43, "kernels": other}))
    with pytest.raises(SystemExit, match=rf"{path.name} was run with kernels AVX2 \(ONEDNN_MAX_CPU_ISA=AVX2\), "
                                         r"this run has AVX512: give another --out, or --force to replace it"):
        refuse_other_kernels(args, presses, HERE)
    refuse_other_kernels(args, ["full"], HERE)  # a run that would not touch that file goes ahead
