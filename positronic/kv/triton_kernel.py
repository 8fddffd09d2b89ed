"""Fused decoding of packed 4-bit rows on a CUDA GPU: one Triton kernel per read of K or V.

`PackedFormat.decode` (kv_formats.py) decodes with plain torch ops: shift, mask, look up,
multiply, cast — each a kernel of its own writing a full-size intermediate (the int32 nibbles
alone are 8× the codes). On a GPU a decode step reads every live row of every layer, so that
chain runs twice per layer and token. `decode_pair` does the same arithmetic in one kernel each for a
layer's keys and values: each program reads a block of rows' codes and scales once and writes
the decoded rows once.

The result is bit-identical to `PackedFormat.decode`: level(nibble) and the float16 scale are
multiplied in float32 (exact: a 4-bit level has at most 3 significant bits, a float16 scale
11) and then cast to the output dtype, as there.

Opt-in: `POSITRONIC_FUSED_DECODE=1` in the environment makes `PackedSpliceLayer` use it when
its rows live on a CUDA device, Triton imports and head_dim is a power of two (Triton's block
sizes are); otherwise, and always on a CPU, the torch ops run. It is off by default because
no GPU was lent to the sessions that wrote it: it has been checked only under Triton's
interpreter (`TRITON_INTERPRET=1`, which runs the kernel on CPU tensors; the tests in
tests/positronic/kv/test_triton_kernel.py run there and on a GPU), never compiled for one.
"""

from __future__ import annotations

import os

import torch

from . import buffers, formats as kv_formats

try:  # Triton ships with CUDA builds of torch; CPU builds (and this project's CI) have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

ROWS_PER_PROGRAM = 32


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter: CPU tensors


def usable(codes: torch.Tensor, head_dim: int) -> bool:
    """Whether `PackedSpliceLayer` should decode `codes` with `decode_pair`: switched on, Triton
    present, the codes on a CUDA device (or any under the interpreter), head_dim a power of two."""
    return (os.environ.get("POSITRONIC_FUSED_DECODE") == "1" and triton is not None
            and (codes.is_cuda or INTERPRETED) and head_dim & (head_dim - 1) == 0)


def decode_pair(key_codes: torch.Tensor, key_scales: torch.Tensor, value_codes: torch.Tensor,
                value_scales: torch.Tensor, levels: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode one layer's live keys and values.

    key_codes, value_codes:   int32   [1, kv_heads, length, head_dim // 8]  (views into the
                                      buffers: any row and head strides, unit word stride)
    key_scales, value_scales: float16 [1, kv_heads, length]
    levels:                   float32 [16]: the value of each nibble (the format's table)
    Returns keys, values: `dtype` [1, kv_heads, length, head_dim], views of one new
    [2, 1, kv_heads, length, head_dim] tensor (as `PackedSpliceLayer._decoded` returns them).
    """
    _, heads, length, words = key_codes.shape
    out = buffers.empty((2, 1, heads, length, words * 8), dtype, key_codes.device)  # every element written below
    if length:
        table = kv_formats.on_device(levels, key_codes.device)
        for codes, scales, rows in ((key_codes, key_scales, out[0]), (value_codes, value_scales, out[1])):
            if codes.stride(-1) != 1:
                raise ValueError("decode_pair reads code words with a unit stride")
            _decode_kernel[(heads, triton.cdiv(length, ROWS_PER_PROGRAM))](
                codes, scales, table, rows, length, codes.stride(1), codes.stride(2), scales.stride(1),
                scales.stride(2), rows.stride(1), HEAD_DIM=words * 8, ROWS=ROWS_PER_PROGRAM)
    return out[0], out[1]


if triton is not None:
    @triton.jit
    def _decode_kernel(codes, scales, levels, out, length, head_stride, row_stride, scale_head_stride,
                       scale_row_stride, out_head_stride, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
        """Program (head, row block): rows ROWS * block .. of one head, decoded into `out`
        (rows of HEAD_DIM contiguous values)."""
        head = tl.program_id(0)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, HEAD_DIM)
        live = rows < length
        # column c is code c % 8 of word c // 8: each word is read by its 8 columns (from cache)
        words = tl.load(codes + head * head_stride + rows[:, None] * row_stride + (cols // 8)[None, :],
                        mask=live[:, None], other=0)
        nibbles = (words >> ((cols % 8) * 4)[None, :]) & 15
        scale = tl.load(scales + head * scale_head_stride + rows * scale_row_stride, mask=live, other=0.0)
        value = tl.load(levels + nibbles) * scale.to(tl.float32)[:, None]
        target = out + head * out_head_stride + rows[:, None] * HEAD_DIM + cols[None, :]
        tl.store(target, value.to(out.dtype.element_ty), mask=live[:, None])
