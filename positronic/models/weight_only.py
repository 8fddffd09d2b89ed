"""`--weights int8-weight-only`: int8 weights, float32 inputs, and the two kernels that sum them.

`WeightOnlyInt8Linear` keeps each output row's weights as int8 with one float32 scale and
computes `weight_only_product`: one loop per output that inductor writes, a row's inputs times
the widened int8 weights, added 16 lanes at a time (AVX-512) into one vector, the lanes then
summed in `vec_reduce_all`'s order. A decode step reads a quarter of float32's bytes; inside a
compiled round (models/compiled.py) the loop is fused with what is around it. Every exactness
promise of the format (decode = prefill, rebuild-from-mirror, batched = alone) rests on a row
getting the same bits whatever rows come with it. But the loop widens each weight again for
every row: a 450-token prompt read at 209-226 tok/s, below llama.cpp's 282 on the same file
(bench/results/weights.md), and a round's products grew with its slots.

The kernel here computes a tile of 6 rows x 4 outputs at a time: each weight vector is widened
once and used for 6 rows, each input vector loaded once for 4 outputs, 24 accumulators in
registers (6 x 4 measured 10-15% faster than 4 x 4, 8 x 2 or 4 x 6 here; 8 x 3 as fast). Each
(row, output) pair still has one accumulator that takes the same additions in the same order as
inductor's loop, with the same `at::vec` operations, the same tail (`sum_masked_reduce`) and the
same lane sum, and it is built by inductor's own C++ builder (its compiler, flags and vector ISA:
no contraction into fused multiply-adds, as there), so its bits are the loop's. That is checked,
not assumed: the first product of each weight shape runs both and compares the bits (NaNs and
signed zeros included); where they differ (another compiler, another ISA) the shape keeps the
loop and the log says so once. Where the kernel does not build (a torch whose builder differs)
the loop serves, and the log says why.

SmolLM2-135M's shapes, 2 threads, AVX-512 (ms a product; 64 rows: a shared prompt chunk):

    shape (out x in)      rows   loop    tiles
    1536 x 576               4    0.16    0.08
    1536 x 576              64    1.63    0.80
    1536 x 576             450   11.86    5.58
    576 x 1536             450   11.86    4.90
    49152 x 576 (logits)   450  424      211

The tiles take every eager product of `ROWS` rows or more: a prompt's chunks, and an eager
batched round (`Batch` without the engine: SmolLM2, B = 4, 65.1 -> 42.6-48.4 ms a round; SmolLM2's
211 products of 2 rows 17.3 -> 13.1 ms, of 3 rows 25.0 -> 13.6). A lone row keeps the loop: on
one row of the logits' 28 MB the tiles were slower (2.28 ms against the loop's 1.15). A compiled round keeps the loop in its graph at every
bucket: the tiles there, an op the graph called, measured slower (SmolLM2 at budget 256, 2
threads: a round of 4 33.6 ms against 26.7, of 8 50.0 against 48.6; with a few rows both are
bound by the same multiplies and adds, and the op's calls and the lost fusions cost more than
the widening saved).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
from torch import nn

from .dynamo import lift_limits

log = logging.getLogger(__name__)
TINY = torch.finfo(torch.float32).tiny


def row_scales(weight: torch.Tensor, levels: int) -> torch.Tensor:
    """weight [rows, columns] -> float32 [rows, 1]: each row's symmetric step, its largest
    magnitude at `levels` (a row of zeros gets the smallest step, not 0)."""
    return weight.abs().amax(1, keepdim=True).clamp_min(TINY) / levels


ROWS = 2  # a lone row takes the loop

SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
using V = at::vec::Vectorized<float>;
constexpr int64_t L = V::size();

// out[m, n] for m in [m0, m0 + MB), n in [n0, n0 + NB): each pair's sum as inductor's loop adds it
template <int MB, int NB>
static inline void tile(float* out, const float* x, const int8_t* w, const float* scale,
                        int64_t m0, int64_t n0, int64_t N, int64_t K) {
    V acc[MB][NB];
    for (int i = 0; i < MB; i++) for (int j = 0; j < NB; j++) acc[i][j] = V(0);
    const int64_t body = L * (K / L);
    for (int64_t k = 0; k < body; k += L) {
        V wv[NB];
        for (int j = 0; j < NB; j++)
            wv[j] = at::vec::convert<float>(at::vec::Vectorized<int8_t>::loadu(w + (n0 + j) * K + k, L));
        for (int i = 0; i < MB; i++) {
            V xv = V::loadu(x + (m0 + i) * K + k, L);
            for (int j = 0; j < NB; j++) { auto p = xv * wv[j]; acc[i][j] = acc[i][j] + p; }
        }
    }
    if (body < K) {
        const int64_t tail = K - body;
        for (int i = 0; i < MB; i++) {
            V xv = V::loadu(x + (m0 + i) * K + body, tail);
            for (int j = 0; j < NB; j++) {
                auto wv = at::vec::convert<float>(at::vec::Vectorized<int8_t>::loadu(w + (n0 + j) * K + body, tail));
                auto p = xv * wv;
                acc[i][j] = sum_masked_reduce(acc[i][j], p, tail);
            }
        }
    }
    for (int i = 0; i < MB; i++) for (int j = 0; j < NB; j++) {
        float total = 0;
        total = total + at::vec::vec_reduce_all<float, 1>([](V& a, V& b) { return a + b; }, acc[i][j]);
        out[(m0 + i) * N + n0 + j] = total * scale[n0 + j];
    }
}

template <int MB>
static inline void outputs(float* out, const float* x, const int8_t* w, const float* scale,
                           int64_t m0, int64_t n0, int64_t n1, int64_t N, int64_t K) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile<MB, 4>(out, x, w, scale, m0, n, N, K);
    for (; n < n1; n++) tile<MB, 1>(out, x, w, scale, m0, n, N, K);
}

// out [M, N] = (x [M, K] . w [N, K] per output) * scale [N]; threads take blocks of 16 outputs
extern "C" void kernel(float* out, const float* x, const int8_t* w, const float* scale,
                       const int64_t M, const int64_t N, const int64_t K) {
    constexpr int64_t BLOCK = 16;
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * BLOCK, n1 = std::min(N, n0 + BLOCK);
        int64_t m = 0;
        for (; m + 6 <= M; m += 6) outputs<6>(out, x, w, scale, m, n0, n1, N, K);
        switch (M - m) {  // the rest in one tile: each weight widened once for them too
            case 5: outputs<5>(out, x, w, scale, m, n0, n1, N, K); break;
            case 4: outputs<4>(out, x, w, scale, m, n0, n1, N, K); break;
            case 3: outputs<3>(out, x, w, scale, m, n0, n1, N, K); break;
            case 2: outputs<2>(out, x, w, scale, m, n0, n1, N, K); break;
            case 1: outputs<1>(out, x, w, scale, m, n0, n1, N, K); break;
        }
    }
}
"""
ARGUMENTS = ["float*", "const float*", "const int8_t*", "const float*", "const int64_t", "const int64_t",
             "const int64_t"]

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_agrees: dict[tuple[int, int], bool] = {}  # weight shape -> whether the tiles gave the loop's bits


@functools.cache
def compiled_kernel():
    """The tiles' kernel, built by inductor's C++ builder on first use (seconds; then its disk
    cache), or None where it cannot be built (the reason logged once)."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        return CppPythonBindingsCodeCache.load_pybinding(ARGUMENTS, SOURCE)
    except Exception as error:  # noqa: BLE001 - no compiler, an older torch: the loop serves
        log.warning("int8-weight-only: the tiled prompt kernel did not build (%s: %s); prompts use "
                    "the one-row loop", type(error).__name__, error)
        return None


def tiled(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x float32 [rows, in], values int8 [out, in], scale float32 [out] -> [rows, out], by the
    tiles (the kernel must exist: `compiled_kernel()`)."""
    x, values, scale = x.contiguous(), values.contiguous(), scale.contiguous()
    out = torch.empty(x.shape[0], values.shape[0], dtype=torch.float32)
    compiled_kernel()(out, x, values, scale, x.shape[0], values.shape[0], x.shape[1])
    return out


def _judge(shape: tuple[int, ...], tiles: torch.Tensor, loop: torch.Tensor) -> bool:
    """Record whether the tiles gave the loop's bits for weights of `shape` (and say so if not)."""
    agrees = _agrees[shape] = same_bits(tiles, loop)
    if not agrees:
        log.warning("int8-weight-only: the tiled kernel's sums differ from the loop's for weights %s on this "
                    "host; those layers keep the loop", "x".join(map(str, shape)))
    return agrees


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def product(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, loop: Product) -> torch.Tensor:
    """`loop(x, values, scale)`'s bits (x float32 [rows, in]), by the tiles where they are faster
    and proven to give those bits for this weight shape (module docstring)."""
    if x.shape[0] < ROWS or x.device.type != "cpu" or compiled_kernel() is None:
        return loop(x, values, scale)
    shape = tuple(values.shape)
    agrees = _agrees.get(shape)
    if agrees is False:
        return loop(x, values, scale)
    out = tiled(x, values, scale)
    if agrees is None and not _judge(shape, out, reference := loop(x, values, scale)):
        return reference
    return out


def weight_only_product(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] float32, values int8 [out, in], scale float32 [out] -> [..., out]: each
    output the sum over the inputs of x times the int8 value, times the output row's scale.
    Written as a broadcast product and a sum so that inductor makes it one loop (the int8
    widened in registers, never a float32 copy of the weight) whose order of additions is
    the kernel's, whatever rows come with it: the same bits for a row alone, in a batch, in a
    prompt chunk, and in a compiled round's graph (tests/positronic/models/test_weights.py).
    Eager it would build [..., out, in] floats: it runs compiled (`_PRODUCT`)."""
    return (x.unsqueeze(-2) * values.to(x.dtype)).sum(-1) * scale


# one graph for any number of rows and any layer shape (a lone row gets one of its own: dynamo
# specialises a size of 1); a few seconds' compile on first use, then inductor's cache on disk
_PRODUCT = torch.compile(weight_only_product, dynamic=True, fullgraph=True)


class WeightOnlyInt8Linear(nn.Module):
    """y = x W^T + b with W as int8 per output row (one float32 scale a row, symmetric, 127
    levels) and x as it comes (float32): `weight_only_product`. `values` int8 [out, in],
    `scale` float32 [out]. Compiled, for a decode step (a few rows) it reads the int8 bytes
    once per row: SmolLM2's 211 products of one row 5.3 ms on a 2-core AVX2 CPU, where
    oneDNN's float32 ones took 82 and fbgemm's int8 25 (bench/results/weights.md). A prompt's
    rows take the tiles below (each weight widened once for 6 rows; the same bits)."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = values.shape
        self.register_buffer("values", values)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, outliers=None) -> "WeightOnlyInt8Linear":
        weight = linear.weight.detach().float()
        scale = row_scales(weight, 127)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(torch.round(weight / scale).clamp_(-127, 127).to(torch.int8), scale[:, 0].contiguous(), bias)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for x [..., in] as an expression (what a compiled round traces: the
        loop, fused with what is around it; the tiles measured slower there, module docstring)."""
        out = weight_only_product(x, self.values, self.scale)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if torch.compiler.is_compiling():  # inside a graph being traced: part of it
            out = weight_only_product(flat, self.values, self.scale)
        elif torch._C._len_torch_dispatch_stack():  # under a dispatch mode (an op counter) nothing compiles:
            # the expression runs eagerly, 256 outputs at a time ([rows, 256, in] floats), its sums torch's
            out = torch.cat([weight_only_product(flat, values, scale)
                             for values, scale in zip(self.values.split(256), self.scale.split(256))], -1)
        else:
            lift_limits()  # a graph per row count of 1 or more, per coincidence of sizes (a few)
            # detached, a view has no base for dynamo to guard on (one compile per caller's layout)
            # a prompt's rows by the tiled kernel, with the loop's bits (below)
            out = product(flat.detach(), self.values, self.scale, _PRODUCT)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
