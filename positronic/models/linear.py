"""Linear layers for CPU forwards over a few rows: a batched decode, a prefill chunk.

A batched tick feeds B sequences' new tokens as B rows ([1, B, hidden]); a prompt goes in
chunks of 64 (positronic.batch). torch computes a linear layer as x @ W.T, and on the CPU
MKL reads the weights of that product at about half speed for a few rows. Measured on this
project's 2-core AMD EPYC, float32, on SmolLM2's shapes (its q, o and MLP layers, 150
matrices, and its lm_head), ms (bench/results/batch.md):

    rows             1     8    64    512
    x @ W.T (torch)  73   130   290   1308
    (W @ x.T).T      66    87   224   1724

A decode forward is mostly that read, so B = 8 costs 1.8x of B = 1 where it could cost 1.2x.
`FewRowsLinear` computes 2 to `FEW_ROWS` rows of a float32 CPU input the second way, and
everything else (one row, long prefills, other dtypes and devices) as torch does (bfloat16
and float16 are slower the second way here: 8 rows 52 and 50 ms against 37 and 32, on a
third of those shapes; their numbers come out the same either way): a tick
that feeds one token gets the same numbers as before. Forwards of 2-64 rows (a batch, a
prompt chunk, a repairer's or recall's rows) differ from before in rounding only (the order
of each dot product's sums), as torch's own kernels for different row counts do.

MKL's W @ x.T rounds differently for weights at different addresses modulo 16 bytes (a
model loaded twice from safetensors gave two answers), so the weights are moved to 64-byte
aligned memory first (torch's own allocations are): the same weights give the same numbers
in every process.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

FEW_ROWS = 64  # up to a prefill chunk (positronic.batch); past ~256 rows torch's own way wins


class FewRowsLinear(nn.Linear):
    """nn.Linear whose forward reads the weights once per few rows at full speed on the CPU
    (see the module docstring). Its parameters and state dict are nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        weight = self.weight
        if not 1 < rows <= FEW_ROWS or x.device.type != "cpu" or weight.dtype != torch.float32 \
                or x.dtype != torch.float32:
            return F.linear(x, weight, self.bias)
        flat = x.reshape(rows, x.shape[-1]).t()  # [in, rows]
        out = torch.mm(weight, flat) if self.bias is None else torch.addmm(self.bias[:, None], weight, flat)
        return out.t().contiguous().reshape(*x.shape[:-1], weight.shape[0])  # contiguous: SDPA's fast path wants it


ALIGN = 64  # bytes


@torch.no_grad()
def use_few_rows_linear(model: nn.Module) -> int:
    """Make every plain nn.Linear of `model` a FewRowsLinear, in place (its class only: the
    parameters stay the same objects, tied ones stay tied). Returns how many layers changed.

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
    for module in linears:
        module.__class__ = FewRowsLinear
    return len(linears)
