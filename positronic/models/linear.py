"""Linear layers for CPU forwards whose rows do not change each other's numbers.

A batched tick feeds B sequences' new tokens as B rows ([1, B, hidden]); a prompt goes in
chunks of 64 (positronic.batch); a brain ticking alone feeds one row. torch computes a
linear layer with MKL, whose kernels differ by row count: one row (a matrix-vector product)
rounds differently from the same row among others, so a sequence in a batch drifted from
itself alone by float rounding, and a near-tie in an eviction or a draw could flip.

`RowInvariantLinear` computes every float32 CPU linear layer with oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, the op torch's own compiler emits for CPU linears),
whose output row for an input row is the same bits for 2 rows or 500 and whatever the other
rows hold, at any weight address and thread count (tests/positronic/models/test_linear.py;
checked on this project's CPU for 1-32 threads and shapes up to 4096 x 11008, a 512-row
prefill's rows included; another CPU's oneDNN kernels are proven by the same tests there).
One row goes in with a row of zeros beside it: oneDNN's one-row kernel is the odd one out.
So each sequence's projections, MLP and logits in a batched forward are bit for bit what it
gets alone.

It is also the faster way on this project's CPU (2-core AMD EPYC, torch 2.13 with MKL 2024.2),
random float32 matrices of SmolLM2's shapes (its 210 q, k, v, o and MLP matrices), ms a
forward, median of 5-9 (bench/results/history/decode.md, "oneDNN linear layers"):

    rows                    1     2     4     8    16    64   512
    torch (MKL x @ W.T)    25    52    49    45    55    86   574
    MKL (W @ x.T).T        25    11    12    25    34    83   679
    oneDNN                 16*   16    18    19    23    44   277     * one row fed as two

MKL's one-row product reads the weights at half the speed of its two-row one on this CPU,
and past 4 rows its kernels compute at half oneDNN's rate. Other dtypes and devices, and
products that autograd must follow, stay torch's own.

The weights are moved to 64-byte aligned memory first (torch's own allocations are), as
before oneDNN when MKL rounded by the weights' address: it costs nothing, and the fallback
keeps the same numbers in every process.

oneDNN reorders a plain weight into its own blocked layout on every call: the matrix is read
twice and written once per product. So each layer keeps a copy in that layout, made on its
first product (laid out for two-row products; `_linear_pointwise` takes it as it is):
SmolLM2's whole forward, 5 runs on this project's CPU, 56.4 -> 51.8 ms with one row and
62.8 -> 49.8 ms with eight (its 211 products alone: 8 rows 54 -> 31-40 ms;
bench/results/history/decode.md). The cost is a second copy of the linear weights (SmolLM2: 538 MB);
when that is more than half the memory available, the layers stay plain
(`use_row_invariant_linear` says so in the log).

The copy also fixes the kernel once, for every row count. On this project's AVX2 CPU the plain
call gives the copy's bits at every row count. On a lent GPU machine's AMX Xeon (torch 2.11,
oneDNN 3.10.2; bench/results/history/gpu.md, 2026-11-30) it does not: there the plain call picks its
kernel by row count, so it is row-invariant only up to 8 rows (64- and 300-row products
differed from the rows alone, by ~1e-6), and it differs from the copy by ~1e-6 at every row
count; the copy for two-row products was row-invariant from 1 to 300 rows (one laid out for
one row was not). So on such CPUs a plain layer keeps decode rounds of up to 8 sequences equal
to alone, but not a prompt chunk fed beside other rows; the log's warning says so.

A weight changed after the copy was made (in place, or replaced) is copied again before its
next product; a write through `weight.data` is not seen (autograd's version counter does not
follow it), and a weight made in inference mode keeps no counter, so it is used plain.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn
from torch.nn import functional as F

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
PACKS = ONEDNN and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
log = logging.getLogger(__name__)


def row_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] float32 on the CPU -> [..., out] by oneDNN, each row's output independent of
    the others (one row is fed beside a row of zeros)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], weight.shape[0])


class RowInvariantLinear(nn.Linear):
    """nn.Linear whose float32 CPU forward gives each row the same bits whatever rows come
    with it (see the module docstring). Its parameters and state dict are nn.Linear's."""

    packs = PACKS  # keep the weight in oneDNN's layout (use_row_invariant_linear may say no)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (not ONEDNN or x.device.type != "cpu" or weight.dtype != torch.float32 or x.dtype != torch.float32
                or not x.shape[-1] or not x.numel()
                or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return F.linear(x, weight, self.bias)
        # an inference tensor keeps no version counter, so a copy could not tell it was changed
        packs = self.packs and not weight.is_inference()
        return row_invariant(x, self._packed(weight) if packs else weight, self.bias)

    def _packed(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` in oneDNN's blocked layout (an opaque mkldnn tensor), made again whenever
        the weight is not the one it was made from (other memory, or written in place since)."""
        stamp = (weight.data_ptr(), weight._version)
        kept = self.__dict__.get("_onednn_weight")  # not a buffer: never saved, never moved
        if kept is None or kept[0] != stamp:
            kept = self.__dict__["_onednn_weight"] = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 2))
        return kept[1]


ALIGN = 64  # bytes


@torch.no_grad()
def use_row_invariant_linear(model: nn.Module) -> int:
    """Make every plain nn.Linear of `model` a RowInvariantLinear, in place (its class only:
    the parameters stay the same objects, tied ones stay tied). Returns how many layers changed.

    If a linear weight is not at an ALIGN-byte address (safetensors maps a file whose tensors
    lie 8-byte aligned), every parameter and buffer not at one is copied to one: copying the
    weights alone kept the whole mapped file alive beside the copies (SmolLM2: 1,431 MB
    resident against 905 MB); with nothing left in it the file is let go, and the model holds
    what it held before."""
    linears = [module for module in model.modules() if type(module) is nn.Linear]
    if any(module.weight.data_ptr() % ALIGN for module in linears):
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.data_ptr() % ALIGN:
                tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
    copy = sum(module.weight.numel() * 4 for module in linears if module.weight.dtype == torch.float32)
    available = available_memory()
    packs = PACKS and (available is None or copy <= available // 2)
    if PACKS and not packs:
        log.warning("the linear layers stay in their plain layout (%.0f MB; %.0f MB of memory available): a copy "
                    "in oneDNN's layout would make the CPU forward faster, and on CPUs whose oneDNN picks kernels by "
                    "row count (AMX Xeons) keep forwards of over 8 rows equal to their rows alone",
                    copy / 1e6, available / 1e6)
    for module in linears:
        module.__class__ = RowInvariantLinear
        module.packs = packs
    return len(linears)


def available_memory() -> int | None:
    """Bytes of memory the system can give without swapping (Linux's MemAvailable), or None
    where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# a compiled round's products on a CPU (models/compiled.py): inductor lowers a float32 linear to
# MKL's packed product, whose row bits depend on the row count on some CPUs (an AMD EPYC: a
# slot's logits differed between buckets 2 and 4), so the graph calls oneDNN as the eager layers
# do, through an op the compiler keeps as it is; its packed weight is kept per weight tensor
_PACKED: dict[int, tuple] = {}


@torch.library.custom_op("positronic::row_linear", mutates_args=())
def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`row_invariant` as one op (x [..., in] float32 on the CPU -> [..., out]) with the weight in
    oneDNN's layout, made once per weight tensor (again if its memory or version changed)."""
    if not PACKS or weight.is_inference():
        return row_invariant(x, weight, bias)
    stamp = (weight.data_ptr(), weight._version, tuple(weight.shape))
    kept = _PACKED.get(id(weight))
    if kept is None or kept[0] != stamp or kept[1]() is not weight:
        kept = _PACKED[id(weight)] = (stamp, weakref.ref(weight, lambda _, key=id(weight): _PACKED.pop(key, None)),
                                      torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 2))
    return row_invariant(x, kept[2], bias)


@row_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
