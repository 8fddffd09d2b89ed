"""A plain round's writes after its forward as one function of tensors (`SlotState.advance`).

After the forward of a round that deletes nothing, every slot's new row gets its position,
token, per-row state and prediction, and the state takes the forward's logits and shares and the
new lengths: about thirty small writes, each a kernel launch on a GPU. `settle` is all of them,
each an `index_put_` on the state's whole tensors (a tensor handed to a compiled function and
written through a view is copied whole; written by index, in place), so that a compiled engine
runs them as one compiled call (`SETTLES`, over the forward's bucket: the padding slots' rows are
written too, in slots no sequence holds, which a joining sequence overwrites). The writes are
copies, and the predictions an argmax: the same bits compiled as eager.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.compiled import Functions

# the state's tensors that take a forward's results (`SlotState._forward`'s, in its order), the
# logits first; the last four only with every layer recorded (None otherwise)
RESULTS = ("next_logits", "attention", "shares", "lane_shares", "lane_peaks", "queries", "log_norms")


def settle(fills: tuple[tuple[str, float], ...], tokens: Tensor, new_rows: Tensor, position: Tensor,
           results: tuple, buffers: dict[str, Tensor], row_state: dict[str, Tensor], scored: dict[str, Tensor]) -> Tensor:
    """S slots' new rows after their forward. tokens, new_rows, position [S] int64: slot s's token,
    the row it took and its position; `results`: the forward's (`SlotState._forward`); `buffers`:
    the state's length, positions, token_ids and its `RESULTS` tensors (whole, written in their
    first S slots); `row_state`: the per-row state's tensors, `scored` the presses' next values
    of some of them [S, ...], `fills` (name, value) a new row's value of each but the predictions. Returns [S] bool: whether each
    slot's new logits are finite."""
    logits = results[0]
    size, device = tokens.shape[0], tokens.device
    lanes = buffers["positions"].shape[1]
    rows = torch.arange(size, device=device)
    new = (rows[:, None], torch.arange(lanes, device=device)[None], new_rows[:, None])  # [S, lanes]: every lane's new row
    buffers["positions"].index_put_(new, position[:, None].expand(size, lanes))
    buffers["token_ids"].index_put_(new, tokens[:, None].expand(size, lanes))
    for name, values in scored.items():
        row_state[name].index_put_((rows,), values.to(row_state[name].dtype))
    for name, fill in fills:
        tensor = row_state[name]
        tensor.index_put_(new if tensor.dim() == 3 else (rows, new_rows), torch.tensor(fill, dtype=tensor.dtype, device=device))
    row_state["predicted"].index_put_(new, logits.argmax(dim=-1)[:, None].expand(size, lanes))
    for name, value in zip(RESULTS, results):
        if value is not None:
            buffers[name].index_put_((rows,), value)
    buffers["length"].index_put_((rows,), new_rows + 1)
    return torch.isfinite(logits.amax(dim=-1))


# shared by every state of a process: one graph per set of per-row states, recorded lanes and bucket
SETTLES = Functions("a plain round's writes")
