"""Which CPU kernels a quality run used, recorded beside its numbers.

torch, oneDNN and MKL pick their kernels by the CPU's vector instructions (AVX2, AVX-512, ...), and
each adds in its own order, so the same run rounds differently on another CPU. A policy that
ranks rows can then keep another row at some step, and the caches part from there: SnapKV's
perplexities moved by −1.3% to +3.2% between AVX2's kernels and AVX-512's, the project's
default by 0.011% at most (bench/results/kvpress.md, 2026-11-29). A table is reproducible only
with the kernels it names, so every quality JSON records them, and bench/significance.py
refuses to pair runs whose records differ.

The three variables below make an AVX-512 CPU run AVX2's kernels; together they reproduced the
AVX2 host's numbers to the last printed digit. On the one cell tried on its own, torch's
(ATEN_CPU_CAPABILITY) was the one that mattered: oneDNN's and MKL's alone left SnapKV's number
where AVX-512 puts it.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/smartkv.py ...

Records compare whole: a CPU that runs AVX2 natively records AVX2 without the variables, and
its runs pair with each other, not with runs the variables made.

Torch-free at import (bench/significance.py reads records without torch).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def record(device: str = "cpu") -> dict:
    """A run's `kernels` record: torch's CPU capability (the kernels it dispatched to, after any
    ATEN_CPU_CAPABILITY) and which of VARIABLES were set; a GPU run records its device name
    instead."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return {"device": torch.cuda.get_device_name()}
    kernels = {"cpu": torch.backends.cpu.get_cpu_capability()}
    kernels.update({name: os.environ[name] for name in VARIABLES if os.environ.get(name)})
    return kernels


def describe(kernels: dict | None) -> str:
    """One line for a record: 'AVX512', 'AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, ...)', or 'not recorded'."""
    if not kernels:
        return "not recorded"
    head = kernels.get("cpu") or kernels.get("device", "?")
    rest = [f"{name}={kernels[name]}" for name in VARIABLES if name in kernels]
    return head + (f" ({', '.join(rest)})" if rest else "")


def refuse_others(kernels: dict, earlier: Iterable[tuple[str, dict | None]], way_out: str) -> None:
    """SystemExit if one of the `earlier` runs (what to call it, its record) that this run would
    join was made with kernels other than `kernels`: its numbers would sit in one table with this
    run's. Runs from before the record (None) are taken as they are."""
    for where, theirs in earlier:
        if theirs is not None and theirs != kernels:
            raise SystemExit(f"{where} was run with kernels {describe(theirs)}, this run has "
                             f"{describe(kernels)}: {way_out}")
