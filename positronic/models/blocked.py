"""int8-weight-only products of several rows at once, each row's sum in the order a decode step's has.

`weight_only_product` (models/weights.py) is one loop per output that inductor writes: a row's
inputs times the widened int8 weights, added 16 lanes at a time (AVX-512) into one vector, the
lanes then summed in `vec_reduce_all`'s order. Decode rounds keep that loop (inside a compiled
round it is fused with what is around it), and every exactness promise of int8-weight-only
(decode = prefill, rebuild-from-mirror, batched = alone) rests on a prompt's rows getting the
same bits. But the loop widens each weight again for every row: a 450-token prompt read at
209-226 tok/s, below llama.cpp's 282 on the same file (bench/results/weights.md).

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

With fewer than `ROWS` rows the loop is used: on one row of the logits' 28 MB the tiles were
slower (1.49 ms against the loop's 0.92), and a decode round's products are inside its graph.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)

ROWS = 4  # fewer rows than this take the loop

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
        for (; m + 3 <= M; m += 3) outputs<3>(out, x, w, scale, m, n0, n1, N, K);
        for (; m < M; m++) outputs<1>(out, x, w, scale, m, n0, n1, N, K);
    }
}
"""
ARGUMENTS = ["float*", "const float*", "const int8_t*", "const float*", "const int64_t", "const int64_t",
             "const int64_t"]

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_kernel: list = []  # [the compiled kernel or None], filled on first use
_agrees: dict[tuple[int, int], bool] = {}  # weight shape -> whether the tiles gave the loop's bits


def compiled_kernel():
    """The tiles' kernel, built by inductor's C++ builder on first use (seconds; then its disk
    cache), or None where it cannot be built (the reason logged once)."""
    if not _kernel:
        try:
            from torch._inductor.codecache import CppPythonBindingsCodeCache
            _kernel.append(CppPythonBindingsCodeCache.load_pybinding(ARGUMENTS, SOURCE))
        except Exception as error:  # noqa: BLE001 - no compiler, an older torch: the loop serves
            log.warning("int8-weight-only: the tiled prompt kernel did not build (%s: %s); prompts use "
                        "the one-row loop", type(error).__name__, error)
            _kernel.append(None)
    return _kernel[0]


def tiled(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x float32 [rows, in], values int8 [out, in], scale float32 [out] -> [rows, out], by the
    tiles (the kernel must exist: `compiled_kernel()`)."""
    x, values, scale = x.contiguous(), values.contiguous(), scale.contiguous()
    out = torch.empty(x.shape[0], values.shape[0], dtype=torch.float32)
    compiled_kernel()(out, x, values, scale, x.shape[0], values.shape[0], x.shape[1])
    return out


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
    if agrees is None:
        agrees = _agrees[shape] = same_bits(out, loop(x, values, scale))
        if not agrees:
            log.warning("int8-weight-only: the tiled prompt kernel's sums differ from the loop's for "
                        "weights %s on this host; those layers keep the loop", "x".join(map(str, shape)))
            return loop(x, values, scale)
    return out
