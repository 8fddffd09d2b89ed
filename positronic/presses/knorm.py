"""`knorm`: the key-norm rule (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based
Strategy for KV Cache Compression"; kvpress's KnormPress): rows whose keys have a large L2
norm tend to receive little attention, so they go first. It reads no attention at all.

A row's norm is its keys' L2 norm averaged over every layer and kv head (RoPE rotates pairs
of dimensions, so a rotated key has its plain key's norm). A key never changes once written:
each row's norm is read once, the round after it arrives, and kept as per-row state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Press, Settings


@dataclass(frozen=True)
class KeyNormSettings(Settings):
    # a share of the attention blended in (0: the key norm alone, as kvpress): value = (1 - mix)
    # * -norm / mean norm + mix * share / mean share, both relative to the sequence's live rows
    mix: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.mix, bool) or not isinstance(self.mix, (int, float)) or not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix must be a number in [0, 1], got {self.mix!r}")


class KeyNormPress(Press):
    """State "norm" [S, N] float64: each row's mean key norm (NaN until read)."""

    name = "knorm"
    plain_rounds = True
    Settings = KeyNormSettings
    row_state = {"norm": (torch.float64, float("nan"))}
    reads_keys = True

    def score(self, rows, state, clock):
        norm = state["norm"].clone()
        live = torch.arange(norm.shape[1], device=norm.device) < rows.length[:, None]
        members, new = (live & norm.isnan()).nonzero(as_tuple=True)
        if len(members):
            keys, _ = rows.read(members, new)  # [n, layers, kv_heads, head_dim]
            norm[members, new] = keys.double().norm(dim=-1).mean(dim=(1, 2)).to(norm.device)
        values = -norm
        if self.settings.mix:
            mean = torch.where(live, norm, 0.0).sum(1, keepdim=True) / rows.length[:, None].clamp(min=1)
            shares = rows.shares.double()
            mean_share = torch.where(live, shares, 0.0).sum(1, keepdim=True) / rows.length[:, None].clamp(min=1)
            values = (1 - self.settings.mix) * values / mean.clamp(min=1e-12) \
                + self.settings.mix * shares / mean_share.clamp(min=1e-12)
        return torch.where(live, values, 0.0), {"norm": norm}
