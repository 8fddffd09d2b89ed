"""Which 4-bit KV format meets the 4-bit cache's targets? A search by fake quantisation.

    python bench/kv_quant_search.py [--text FILE ...] [--offset 60000] [--tokens 1024]
                                    [--only NAME|=NAME ...] [--rotation-seed N] [--threads 1]

Teacher-forced perplexity of SmolLM2 over --tokens tokens of each --text (from character
--offset, starting after the first blank line there; BOS first, as `run.py eval` does) with
the full cache, its K and V rows quantised and dequantised as they enter the cache (a
DynamicCache whose `update` rounds the new rows: the model then attends over the rounded
rows, the newest included, exactly as over a PackedSpliceLayer). One forward over the whole
text: every candidate here rounds each row on its own, so a row's rounding does not depend
on when the other rows arrive, and one forward equals token-by-token decoding.

Every candidate stores 4-bit codes; what differs is what the scales cover and any fixed
transform. "bits/value" counts the codes and every per-row or per-group parameter (float16
scale, zero point, the float16 values of kept channels), averaged over K and V; "vs f16" is
bits/value / 16 (the target: <= 0.3, i.e. <= 4.8 bits/value). Fixed tables (a
Hadamard matrix, per-channel factors: 30 x 3 x 64 numbers for SmolLM2) are per model, not
per token, and are not counted.

Candidates (K / V):
  int4-row        today's int4: symmetric, levels -7..7, float16 scale = max|row| / 7
  fp4-row         today's fp4 (E2M1, scale = max|row| / 6)
  *-g32, *-g16    the same with one scale per group of 32 (16) channels along head_dim
  *-s8            the group scale in float8 E4M3 instead of float16 (1 byte)
  had-*           a fixed 64x64 Hadamard rotation along head_dim before quantising (undone
                  on decode; orthogonal, so it spreads an outlier channel over the row)
  asym-*          min/max with a zero point: x ~ (q - z) * s, q in 0..15; "z16": the offset
                  kept as a float16 (x ~ q * s + m), "z4": an integer zero point in 4 bits
  chan-*          keys divided by a fixed per-(layer, kv head, channel) factor before
                  quantising and multiplied back after (the factor from the model's weights:
                  the norm of each k_proj row times the input RMSNorm weight; RoPE mixes
                  channel i with i + head_dim/2, so the two share the root-mean-square of
                  their norms). A static stand-in for per-channel key scales (KIVI quantises
                  keys per channel over tokens, which a row edit cannot carry with a row).
  keep2-*         the two channels of one RoPE pair (the largest weight-derived norm) kept
                  in float16, the other 62 quantised (the idea of keeping outlier channels in
                  high precision, as in LLM.int8 / KVQuant's dense-and-sparse split)
  clip / clip+    per group, the range shrunk by the factor (1, 0.95, .. 0.8; clip+: 1 .. 0.6
                  in steps of 0.025) that gives the least squared error (same storage)
  nf4             16 levels at normal quantiles (the NF4 construction of QLoRA) times
                  max|group|: a rotated row's values are close to normal
  BOS row float   the first row kept unquantised (IntactKV's "pivot tokens" idea)
  K-only / V-only diagnostics: one side quantised, the other float.

  pre-*           keys quantised before RoPE (KVQuant's observation: before the rotation an
                  outlier channel stays the same channel for every token): the stored key is
                  un-rotated to position 0 (exact in float32), quantised, rotated back.
                  "cal": divided by a fixed per-(layer, kv head, channel) factor first, the
                  root-mean-square of that channel's pre-RoPE keys over --calibration (a text
                  not measured here), multiplied back after: a static stand-in for KVQuant's
                  per-channel key scales that a row still carries alone.
  mean-*          (round 6) keys minus each layer's mean pre-RoPE key over --calibration,
                  rotated to the row's position (a position-aware static offset), quantised,
                  added back; post-*: the same with one fixed post-RoPE mean (no positions)
  pre-mean-*      keys stored before RoPE, centred: what `--kv-format int4h` stores
  int4h ...       (round 7) int4h as built (centres from positronic/kv/centres.py), and
                  with a clip search, value centres, key groups of 16
  best-of-32      (round 8) per (layer, kv head), the rotation (H times one of 32 fixed
                  sign vectors) whose quantisation of the calibration rows has the least
                  squared error

--rotation-seed N multiplies the Hadamard matrix by a diagonal of random signs (another fixed
orthogonal rotation): the spread over seeds shows how much of a 1-2% difference between two
candidates is the luck of where the rounding falls rather than the format.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers.cache_utils import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.texts import excerpt  # noqa: E402
from positronic import load_model, with_cache
from positronic.kv import rope  # noqa: E402
from positronic.kv.centres import compute_key_centres, key_centres  # noqa: E402
from positronic.kv.formats import hadamard  # noqa: E402,F401  (also the tests' search.hadamard)
from positronic.texts import DEFAULT_TEXT  # noqa: E402

Quant = Callable[[torch.Tensor, int], torch.Tensor]  # rows [1, kv_heads, n, head_dim], layer -> rounded rows
F16 = torch.float16
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8)
CLIPS_WIDE = tuple(1.0 - 0.025 * i for i in range(17))  # 1.0 .. 0.6
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# --- codecs: quantise and dequantise in float32 --------------------------------------------

def _groups(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """[..., d] -> [..., d / group, group]; no group, or one wider than the row: the row."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], -1, min(group or d, d))


def _least_error(groups: torch.Tensor, roundings) -> torch.Tensor:
    """Per group (last dim), the rounding of `groups` with the least squared error."""
    best = err = None
    for out in roundings:
        e = (out - groups).pow(2).sum(-1, keepdim=True)
        if best is None:
            best, err = out, e
        else:
            better = e < err
            best, err = torch.where(better, out, best), torch.where(better, e, err)
    return best


def _scale(amax: torch.Tensor, top: float, scale_dtype: torch.dtype) -> torch.Tensor:
    s = (amax / top).to(scale_dtype).float()
    return torch.where(s > 0, s, torch.ones_like(s))


def sym_int4(x: torch.Tensor, group: int | None = None, scale_dtype=F16,
             clips: tuple[float, ...] = (1.0,)) -> torch.Tensor:
    """Symmetric int4 (levels -7..7), one scale = max|group| / 7 per group (None: the row);
    clips as for asym_int4."""
    g = _groups(x, group)

    def rounded(c):
        s = _scale(g.abs().amax(-1, keepdim=True) * c, 7.0, scale_dtype)
        return (g / s).round().clamp(-7, 7) * s
    return _least_error(g, map(rounded, clips)).reshape(x.shape)


def sym_fp4(x: torch.Tensor, group: int | None = None, scale_dtype=F16) -> torch.Tensor:
    """FP4 E2M1, one scale = max|group| / 6 per group: each value to its nearest level."""
    g = _groups(x, group)
    s = _scale(g.abs().amax(-1, keepdim=True), 6.0, scale_dtype)
    a = (g / s).abs().clamp(max=6.0)
    mids = ((E2M1[1:] + E2M1[:-1]) / 2).to(x.device)
    level = E2M1.to(x.device)[torch.bucketize(a.contiguous(), mids)]
    return (torch.sign(g) * level * s).reshape(x.shape)


def _nf4_levels() -> torch.Tensor:
    """16 levels at quantiles of a normal distribution, scaled to [-1, 1] with an exact 0 (the
    construction QLoRA's NF4 describes: 8 positive and 7 negative quantiles): after a Hadamard
    rotation a row's values are close to normal."""
    normal = torch.distributions.Normal(0.0, 1.0)
    offset = 0.9677
    pos = normal.icdf(torch.linspace(offset, 0.5, 9)[:-1])
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8)[:-1])
    levels = torch.cat([pos, torch.zeros(1), neg]).sort().values
    return levels / levels.abs().max()


NF4 = _nf4_levels()


def sym_nf4(x: torch.Tensor, group: int | None = None, scale_dtype=F16) -> torch.Tensor:
    """NF4 levels times one scale = max|group| per group, each value to its nearest level."""
    g = _groups(x, group)
    s = _scale(g.abs().amax(-1, keepdim=True), 1.0, scale_dtype)
    levels = NF4.to(x.device)
    mids = (levels[1:] + levels[:-1]) / 2
    return (levels[torch.bucketize((g / s).clamp(-1, 1), mids)] * s).reshape(x.shape)


def asym_int4(x: torch.Tensor, group: int | None = None, zero: str = "z16", scale_dtype=F16,
              clips: tuple[float, ...] = (1.0,)) -> torch.Tensor:
    """Min/max int4 (q in 0..15) per group. z16: x ~ q*s + m, m = min in float16; z4: an
    integer zero point z in 0..15 (4 bits), x ~ (q - z)*s, so 0 is exactly representable.
    clips: the range [lo, hi] shrunk by each factor, per group the one of least squared error
    (same storage)."""
    g = _groups(x, group)
    lo0, hi0 = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    if zero == "z4":
        lo0, hi0 = lo0.clamp(max=0), hi0.clamp(min=0)  # the integer grid has to contain 0

    def rounded(c):
        lo, hi = lo0 * c, hi0 * c
        s = _scale(hi - lo, 15.0, scale_dtype)
        if zero == "z16":
            m = lo.to(F16).float()
            return ((g - m) / s).round().clamp(0, 15) * s + m
        z = (-lo / s).round().clamp(0, 15)
        return ((g / s).round() + z).clamp(0, 15).sub(z) * s
    return _least_error(g, map(rounded, clips)).reshape(x.shape)


# --- the fake-quantising cache -------------------------------------------------------------

class FakeQuantCache(DynamicCache):
    """A DynamicCache that rounds each new K and V row (quantise + dequantise) before storing
    it and before attention reads it."""

    def __init__(self, kq: Quant | None, vq: Quant | None):
        super().__init__()
        self.kq, self.vq = kq, vq

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.kq is not None:
            key_states = self.kq(key_states.float(), layer_idx).to(key_states.dtype)
        if self.vq is not None:
            value_states = self.vq(value_states.float(), layer_idx).to(value_states.dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.no_grad()
def mean_nll(lm, ids: list[int], kq: Quant | None, vq: Quant | None) -> float:
    x = torch.tensor([ids], device=lm.device)
    logits = lm.model(input_ids=x, **with_cache(FakeQuantCache(kq, vq)), use_cache=True).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, x[0, 1:]))


# --- candidates ----------------------------------------------------------------------------

@dataclass
class Candidate:
    name: str
    k: Quant | None
    v: Quant | None
    k_bits: float  # per value, codes and per-row/group parameters
    v_bits: float
    note: str = ""

    @property
    def bits(self) -> float:
        return (self.k_bits + self.v_bits) / 2


def weight_channel_norms(lm) -> torch.Tensor:
    """[layers, kv_heads, head_dim]: |k_proj row| weighted by the input RMSNorm weight, the two
    channels of each RoPE pair (i, i + head_dim/2) sharing their root-mean-square."""
    d, out = lm.head_dim, []
    for layer in lm.model.model.layers:
        w = layer.self_attn.k_proj.weight.float() * layer.input_layernorm.weight.float()[None, :]
        n = w.norm(dim=1).view(lm.num_kv_heads, d)
        half = n.view(lm.num_kv_heads, 2, d // 2).pow(2).mean(1).sqrt()
        out.append(torch.cat([half, half], dim=-1))
    return torch.stack(out)


@torch.no_grad()
def pre_rope_channel_rms(lm, ids: list[int]) -> torch.Tensor:
    """[layers, kv_heads, head_dim]: root-mean-square of each pre-RoPE key channel over `ids`
    (their mean is positronic.kv.centres.compute_key_centres)."""
    from positronic.smartkv.labels import KeyUnrotator

    cache = DynamicCache(config=lm.model.config)
    lm.model(input_ids=torch.tensor([ids], device=lm.device), **with_cache(cache), use_cache=True)
    unrotate = KeyUnrotator.for_config(lm.model.config)
    out = []
    for layer in cache.layers:
        plain = unrotate(layer.keys, torch.arange(len(ids)))  # [n, kv_heads * head_dim]
        out.append(plain.pow(2).mean(0).sqrt().view(lm.num_kv_heads, lm.head_dim))
    return torch.stack(out)


@torch.no_grad()
def post_rope_channel_mean(lm, ids: list[int]) -> torch.Tensor:
    """[layers, kv_heads, head_dim]: mean of each stored (post-RoPE) key channel over `ids`."""
    cache = DynamicCache(config=lm.model.config)
    lm.model(input_ids=torch.tensor([ids], device=lm.device), **with_cache(cache), use_cache=True)
    return torch.stack([layer.keys[0].float().mean(1) for layer in cache.layers])


def candidates(lm, rotation_seed: int = 0, calibration: list[int] | None = None) -> list[Candidate]:
    d = lm.head_dim
    H = hadamard(d)
    if rotation_seed:  # diag(random signs) @ H: another fixed orthogonal rotation, to see the spread
        signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(rotation_seed)) * 2 - 1
        H = signs[:, None].float() * H
    H = H.to(lm.device)
    Hinv = H.T.contiguous()
    norms = weight_channel_norms(lm).to(lm.device)  # [L, heads, d]

    def rows(fn: Callable[[torch.Tensor], torch.Tensor]) -> Quant:
        return lambda x, layer: fn(x)

    def rotated(fn):
        return lambda x, layer=None: fn(x @ H) @ Hinv

    def channel_scaled(fn, alpha: float):
        def q(x, layer):
            c = norms[layer].pow(alpha)[None, :, None, :]
            c = c / c.mean()
            return fn(x / c) * c
        return q

    def keep_top_pair(fn):
        top = norms[..., : d // 2].argmax(-1)  # [L, heads]: the RoPE pair with the largest norm
        mask = torch.zeros_like(norms, dtype=torch.bool)
        mask.scatter_(-1, top.unsqueeze(-1), True)
        mask.scatter_(-1, (top + d // 2).unsqueeze(-1), True)

        def q(x, layer):
            m = mask[layer][None, :, None, :]
            return torch.where(m, x.to(F16).float(), fn(torch.where(m, torch.zeros_like(x), x)))
        return q

    def keep_bos(q):
        def f(x, layer):
            out = q(x, layer)
            out[:, :, 0] = x[:, :, 0]  # one forward over the text: row 0 is BOS
            return out
        return f

    from positronic.smartkv.labels import KeyUnrotator

    unrotator = KeyUnrotator.for_config(lm.model.config)
    inv_freq = unrotator.inv_freq.to(lm.device)
    channel_rms = pre_rope_channel_rms(lm, calibration) if calibration else None

    def pre_rope(fn, calibrated: bool = False):
        """Quantise keys [1, kv_heads, n, d] un-rotated (one forward over the text: row i is at
        position i), optionally divided by the calibrated channel RMS, then rotate back."""
        def q(x, layer):
            n = x.shape[2]
            at = torch.arange(n, device=x.device)
            plain = unrotator(x, at).view(n, lm.num_kv_heads, d).transpose(0, 1)[None]  # [1, kv, n, d]
            c = channel_rms[layer].to(x.device)[None, :, None, :] if calibrated else None
            out = fn(plain / c) * c if calibrated else fn(plain)
            angles = at[:, None].float() * inv_freq[None, :]
            cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
            half = d // 2
            rot = torch.cat([-out[..., half:], out[..., :half]], -1)
            return out * cos + rot * sin
        return q

    channel_mean = compute_key_centres(lm, calibration) if calibration else None

    def mean_offset(fn):
        """Keys [1, kv_heads, n, d] (row i at position i) minus the calibrated pre-RoPE channel
        mean rotated to each row's position; the residual quantised by `fn`, the mean added back."""
        def q(x, layer):
            n = x.shape[2]
            at = torch.arange(n, device=x.device)
            angles = at[:, None].float() * inv_freq[None, :]
            cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
            m = channel_mean[layer].to(x.device)[None, :, None, :]  # [1, kv, 1, d]
            half = d // 2
            m_at = m * cos + torch.cat([-m[..., half:], m[..., :half]], -1) * sin  # [1, kv, n, d]
            return fn(x - m_at) + m_at
        return q

    i4 = rows(sym_int4)
    i4g32 = rows(lambda x: sym_int4(x, 32))
    best_v = rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS))
    out = [
        Candidate("float", None, None, 16, 16, "reference"),
        Candidate("int4-row (today)", i4, i4, 4.25, 4.25),
        Candidate("fp4-row (today)", rows(sym_fp4), rows(sym_fp4), 4.25, 4.25),
        Candidate("int4-row K only", i4, None, 4.25, 16, "diagnostic"),
        Candidate("int4-row V only", None, i4, 16, 4.25, "diagnostic"),
        Candidate("int4-g32", i4g32, i4g32, 4.5, 4.5),
        Candidate("int4-g16", rows(lambda x: sym_int4(x, 16)), rows(lambda x: sym_int4(x, 16)), 5.0, 5.0),
        Candidate("int4-g16-s8", rows(lambda x: sym_int4(x, 16, torch.float8_e4m3fn)),
                  rows(lambda x: sym_int4(x, 16, torch.float8_e4m3fn)), 4.5, 4.5),
        Candidate("fp4-g32", rows(lambda x: sym_fp4(x, 32)), rows(lambda x: sym_fp4(x, 32)), 4.5, 4.5),
        Candidate("fp4-g16-s8", rows(lambda x: sym_fp4(x, 16, torch.float8_e4m3fn)),
                  rows(lambda x: sym_fp4(x, 16, torch.float8_e4m3fn)), 4.5, 4.5),
        Candidate("had-int4-row", rotated(sym_int4), rotated(sym_int4), 4.25, 4.25),
        Candidate("had-int4-row K, int4-row V", rotated(sym_int4), i4, 4.25, 4.25),
        Candidate("had-int4-g32", rotated(lambda x: sym_int4(x, 32)), rotated(lambda x: sym_int4(x, 32)), 4.5, 4.5),
        Candidate("had-int4-g32 K, int4-row V", rotated(lambda x: sym_int4(x, 32)), i4, 4.5, 4.25),
        Candidate("had-fp4-row", rotated(sym_fp4), rotated(sym_fp4), 4.25, 4.25),
        Candidate("asym-int4-row z16", rows(asym_int4), rows(asym_int4), 4.5, 4.5),
        Candidate("asym-int4-g32 z16", rows(lambda x: asym_int4(x, 32)), rows(lambda x: asym_int4(x, 32)), 5.0, 5.0,
                  "over 0.3x"),
        Candidate("asym-int4-g32 z4", rows(lambda x: asym_int4(x, 32, "z4")),
                  rows(lambda x: asym_int4(x, 32, "z4")), 4.625, 4.625),
        Candidate("int4-g32 K, int4-row V", i4g32, i4, 4.5, 4.25),
        Candidate("int4-g16 K, int4-row V", rows(lambda x: sym_int4(x, 16)), i4, 5.0, 4.25),
        Candidate("chan-int4-row K (a=0.5), int4-row V", channel_scaled(sym_int4, 0.5), i4, 4.25, 4.25),
        Candidate("chan-int4-row K (a=1), int4-row V", channel_scaled(sym_int4, 1.0), i4, 4.25, 4.25),
        Candidate("chan-int4-g32 K (a=1), int4-row V", channel_scaled(lambda x: sym_int4(x, 32), 1.0), i4, 4.5, 4.25),
        Candidate("keep2-int4-row K, int4-row V", keep_top_pair(sym_int4), i4, (62 * 4 + 2 * 16 + 16) / 64, 4.25),
        Candidate("had-int4-g32 K, had-int4-row V", rotated(lambda x: sym_int4(x, 32)), rotated(sym_int4), 4.5, 4.25),
        Candidate("had-fp4-g32", rotated(lambda x: sym_fp4(x, 32)), rotated(lambda x: sym_fp4(x, 32)), 4.5, 4.5),
        Candidate("had-asym-int4-g32 z4", rotated(lambda x: asym_int4(x, 32, "z4")),
                  rotated(lambda x: asym_int4(x, 32, "z4")), 4.625, 4.625),
        Candidate("had-asym-int4-row z16", rotated(asym_int4), rotated(asym_int4), 4.5, 4.5),
        # round 2: keys get the larger share of the 4.8 bits/value (values alone cost ~1%)
        Candidate("had-asym-int4-g32 z16 K, had-int4-row V", rotated(lambda x: asym_int4(x, 32)), rotated(sym_int4),
                  5.0, 4.25),
        Candidate("had-int4-g16 K, had-int4-row V", rotated(lambda x: sym_int4(x, 16)), rotated(sym_int4), 5.0, 4.25),
        Candidate("had-asym-int4-g16 z4 K, had-int4-row V", rotated(lambda x: asym_int4(x, 16, "z4")),
                  rotated(sym_int4), 5.25, 4.25),
        Candidate("had-asym-int4-g16 z4 K, had-asym-int4-row z16 V", rotated(lambda x: asym_int4(x, 16, "z4")),
                  rotated(asym_int4), 5.25, 4.5, "over 0.3x"),
        Candidate("had-asym-int4-g32 z4 clip", rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS)),
                  rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS)), 4.625, 4.625),
        Candidate("had-asym-int4-g16 z4 clip K, had-int4-row V", rotated(lambda x: asym_int4(x, 16, "z4", clips=CLIPS)),
                  rotated(sym_int4), 5.25, 4.25),
        Candidate("had-asym-int4-g16 z4 s8 K, had-asym-int4-g32 z4 V",
                  rotated(lambda x: asym_int4(x, 16, "z4", torch.float8_e4m3fn)),
                  rotated(lambda x: asym_int4(x, 32, "z4")), 4.75, 4.625),
        Candidate("chan-had-asym-int4-g32 z4 K (a=1), had-asym-int4-g32 z4 V",
                  channel_scaled(rotated(lambda x: asym_int4(x, 32, "z4")), 1.0),
                  rotated(lambda x: asym_int4(x, 32, "z4")), 4.625, 4.625),
        # round 3: wider clipping search, diagnostics, the BOS row kept in float (IntactKV's "pivot tokens")
        Candidate("had-asym-int4-g32 z4 clip K only", rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS)), None,
                  4.625, 16, "diagnostic"),
        Candidate("had-asym-int4-g32 z4 clip V only", None, rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS)),
                  16, 4.625, "diagnostic"),
        Candidate("had-asym-int4-g32 z4 clip+", rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS_WIDE)),
                  rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS_WIDE)), 4.625, 4.625),
        Candidate("had-asym-int4-g16 z4 s8 clip K, had-asym-int4-g32 z4 clip V",
                  rotated(lambda x: asym_int4(x, 16, "z4", torch.float8_e4m3fn, clips=CLIPS)),
                  rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS)), 4.75, 4.625),
        Candidate("had-asym-int4-g32 z4 clip, BOS row float",
                  keep_bos(rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS))),
                  keep_bos(rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS))), 4.625, 4.625,
                  "+ one float row per layer"),
        Candidate("had-int4-g32 clip", rotated(lambda x: sym_int4(x, 32, clips=CLIPS)),
                  rotated(lambda x: sym_int4(x, 32, clips=CLIPS)), 4.5, 4.5),
        # round 4: normal-float levels after the rotation
        Candidate("had-nf4-row", rotated(sym_nf4), rotated(sym_nf4), 4.25, 4.25),
        Candidate("had-nf4-g32", rotated(lambda x: sym_nf4(x, 32)), rotated(lambda x: sym_nf4(x, 32)), 4.5, 4.5),
        Candidate("had-nf4-g16-s8", rotated(lambda x: sym_nf4(x, 16, torch.float8_e4m3fn)),
                  rotated(lambda x: sym_nf4(x, 16, torch.float8_e4m3fn)), 4.5, 4.5),
        Candidate("had-nf4-g16 K, had-nf4-row V", rotated(lambda x: sym_nf4(x, 16)), rotated(sym_nf4), 5.0, 4.25),
        # round 5: keys quantised before RoPE, values as the best format so far
        Candidate("pre-float K (check: un-rotate, rotate back)", pre_rope(lambda x: x), None, 16, 16, "diagnostic"),
        Candidate("pre-int4-row K, had-asym-g32 z4 clip V", pre_rope(sym_int4), best_v, 4.25, 4.625),
        Candidate("pre-asym-int4-g32 z4 clip K, had-asym-g32 z4 clip V",
                  pre_rope(lambda x: asym_int4(x, 32, "z4", clips=CLIPS)), best_v, 4.625, 4.625),
    ]
    if channel_rms is not None:
        out += [
            Candidate("pre-cal-int4-row K, had-asym-g32 z4 clip V", pre_rope(sym_int4, True), best_v, 4.25, 4.625),
            Candidate("pre-cal-int4-g32 clip K, had-asym-g32 z4 clip V",
                      pre_rope(lambda x: sym_int4(x, 32, clips=CLIPS), True), best_v, 4.5, 4.625),
            Candidate("pre-cal-asym-int4-g32 z4 clip K, had-asym-g32 z4 clip V",
                      pre_rope(lambda x: asym_int4(x, 32, "z4", clips=CLIPS), True), best_v, 4.625, 4.625),
            Candidate("pre-cal-had-asym-int4-g32 z4 clip K, had-asym-g32 z4 clip V",
                      pre_rope(rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS)), True), best_v, 4.625, 4.625),
            Candidate("pre-cal-asym-int4-g32 z4 clip K only",
                      pre_rope(lambda x: asym_int4(x, 32, "z4", clips=CLIPS), True), None, 4.625, 16, "diagnostic"),
        ]
    post_mean = post_rope_channel_mean(lm, calibration) if calibration else None

    def post_offset(fn):
        """Keys minus a fixed post-RoPE channel mean (the calibration text's, over its
        positions): no position needed to add it back."""
        def q(x, layer):
            m = post_mean[layer].to(x.device)[None, :, None, :]
            return fn(x - m) + m
        return q

    if post_mean is not None:  # round 6b: the same without positions
        out += [
            Candidate("post-had-asym-int4-g32 z4 clip K, had-asym-g32 z4 clip V",
                      post_offset(rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS))), best_v, 4.625, 4.625),
            Candidate("post-had-int4-g32 clip K, had-int4-g32 clip V",
                      post_offset(rotated(lambda x: sym_int4(x, 32, clips=CLIPS))),
                      rotated(lambda x: sym_int4(x, 32, clips=CLIPS)), 4.5, 4.5),
        ]

    def pre_centred(fn):
        """Keys un-rotated to position 0 (stored before RoPE), minus the calibrated channel
        mean, quantised by `fn`, the mean added back, rotated back to their positions."""
        def q(x, layer):
            m = channel_mean[layer].to(x.device)[None, :, None, :]
            return pre_rope(lambda plain: fn(plain - m) + m)(x, layer)
        return q

    shipped = key_centres(lm).to(lm.device)  # int4h's own centres (the package's text)

    def pre_centred_by(centres, fn):
        def q(x, layer):
            m = centres[layer][None, :, None, :]
            return pre_rope(lambda plain: fn(plain - m) + m)(x, layer)
        return q

    value_mean = None
    if calibration:
        with torch.no_grad():
            vcache = DynamicCache(config=lm.model.config)
            lm.model(input_ids=torch.tensor([calibration], device=lm.device), **with_cache(vcache), use_cache=True)
            value_mean = torch.stack([layer.values[0].float().mean(1) for layer in vcache.layers])

    def value_centred(fn):
        def q(x, layer):
            m = value_mean[layer][None, :, None, :]
            return fn(x - m) + m
        return q

    asym = rotated(lambda x: asym_int4(x, 32, "z4"))
    asym_clip = rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS))
    out += [  # round 7: the int4h format as built, and what might close its last percent
        Candidate("int4h as built (pre-RoPE, centres from the package's text, had-asym-g32 z4)",
                  pre_centred_by(shipped, asym),
                  asym, 4.75, 4.75),
        Candidate("int4h + clip K", pre_centred_by(shipped, asym_clip), asym, 4.75, 4.75),
        Candidate("int4h + clip K and V", pre_centred_by(shipped, asym_clip), asym_clip, 4.75, 4.75),
    ]
    out += [
        Candidate("int4h K g16, V had-asym-g64", pre_centred_by(shipped, rotated(lambda x: asym_int4(x, 16, "z4"))),
                  rotated(lambda x: asym_int4(x, 64, "z4")), 5.25, 4.375),
        Candidate("int4h K g16, V had-int4-row", pre_centred_by(shipped, rotated(lambda x: asym_int4(x, 16, "z4"))),
                  rotated(sym_int4), 5.25, 4.25),
        Candidate("int4h K g32, V had-int4-row", pre_centred_by(shipped, asym), rotated(sym_int4), 4.75, 4.25),
    ]
    # round 8: per (layer, kv head), the rotation (H times random signs, best of 32) whose int4h
    # quantisation of the calibration text's keys / values has the least squared error
    calib_ids = calibration or ([lm.bos_id] + lm.encode(DEFAULT_TEXT.read_text())[:511])
    with torch.no_grad():
        ccache = DynamicCache(config=lm.model.config)
        lm.model(input_ids=torch.tensor([calib_ids], device=lm.device), **with_cache(ccache), use_cache=True)
    n = len(calib_ids)
    cpos = torch.arange(n)
    ccos, csin = rope.rotation(lm.inv_freq, cpos, torch.zeros_like(cpos))
    gen = torch.Generator().manual_seed(123 + rotation_seed)
    sign_sets = torch.cat([torch.ones(1, d), torch.randint(0, 2, (31, d), generator=gen).float() * 2 - 1])  # [32, d]
    H0 = hadamard(d)

    def best_rotations(rows_of_layer):  # rows [L][kv, n, d] -> [L, kv, d, d]
        out_r = []
        for rows in rows_of_layer:
            per_head = []
            for h in range(rows.shape[0]):
                x = rows[h]  # [n, d]
                errs = []
                for sgn in sign_sets:
                    R = sgn[:, None] * H0
                    c = x @ R
                    errs.append(float((asym_int4(c, 32, "z4") - c).pow(2).sum()))
                per_head.append(sign_sets[int(torch.tensor(errs).argmin())][:, None] * H0)
            out_r.append(torch.stack(per_head))
        return torch.stack(out_r)

    key_rows = [rope.rotate(l.keys.float(), ccos, csin)[0] - shipped[i][:, None, :].cpu() for i, l in enumerate(ccache.layers)]
    val_rows = [l.values.float()[0] for l in ccache.layers]
    key_rot, val_rot = best_rotations(key_rows), best_rotations(val_rows)

    def per_head_rotated(fn, rots):
        def q(x, layer):
            R = rots[layer].to(x.device)  # [kv, d, d]
            c = torch.einsum("bhnd,hde->bhne", x, R)
            return torch.einsum("bhne,hde->bhnd", fn(c), R)
        return q

    def pre_centred_fn(centres, q_fn):
        def q(x, layer):
            m = centres[layer][None, :, None, :]
            return pre_rope(lambda plain: q_fn(plain - m, layer) + m)(x, layer)
        return q

    plain_asym = lambda x: asym_int4(x, 32, "z4")  # noqa: E731
    out += [Candidate("int4h + best-of-32 rotation per head (K and V)",
                      pre_centred_fn(shipped, per_head_rotated(plain_asym, key_rot)),
                      per_head_rotated(plain_asym, val_rot), 4.75, 4.75)]
    if value_mean is not None:
        out += [Candidate("int4h + value mean", pre_centred_by(shipped, asym), value_centred(asym), 4.75, 4.75),
                Candidate("int4h calibrated on --calibration", pre_centred_by(channel_mean, asym), asym, 4.75, 4.75)]
    if channel_mean is not None:  # round 6c: the same, keys stored before RoPE (re-rotation = a new position)
        out += [
            Candidate("pre-mean-had-asym-int4-g32 z4 clip K, had-asym-g32 z4 clip V",
                      pre_centred(rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS))), best_v, 4.625, 4.625),
            Candidate("pre-mean-had-asym-int4-g32 z4 K, had-asym-int4-g32 z4 V",
                      pre_centred(rotated(lambda x: asym_int4(x, 32, "z4"))), rotated(lambda x: asym_int4(x, 32, "z4")),
                      4.625, 4.625),
            Candidate("pre-mean-had-int4-g32 K, had-int4-g32 V", pre_centred(rotated(lambda x: sym_int4(x, 32))),
                      rotated(lambda x: sym_int4(x, 32)), 4.5, 4.5),
            Candidate("pre-had-asym-int4-g32 z4 clip K, had-asym-g32 z4 clip V",
                      pre_rope(rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS))), best_v, 4.625, 4.625),
        ]
    if channel_mean is not None:  # round 6: a static per-channel offset, position-aware
        had_best = rotated(lambda x: asym_int4(x, 32, "z4", clips=CLIPS))
        out += [
            Candidate("mean-had-asym-int4-g32 z4 clip K, had-asym-g32 z4 clip V", mean_offset(had_best),
                      best_v, 4.625, 4.625),
            Candidate("mean-asym-int4-g32 z4 clip K, had-asym-g32 z4 clip V",
                      mean_offset(lambda x: asym_int4(x, 32, "z4", clips=CLIPS)), best_v, 4.625, 4.625),
            Candidate("mean-had-int4-row K, had-asym-g32 z4 clip V", mean_offset(rotated(sym_int4)),
                      best_v, 4.25, 4.625),
            Candidate("mean-had-int4-g32 clip K, had-asym-g32 z4 clip V",
                      mean_offset(rotated(lambda x: sym_int4(x, 32, clips=CLIPS))), best_v, 4.5, 4.625),
            Candidate("mean-had-int4-g32 K, had-int4-g32 V", mean_offset(rotated(lambda x: sym_int4(x, 32))),
                      rotated(lambda x: sym_int4(x, 32)), 4.5, 4.5),
            Candidate("mean-had-asym-int4-g32 z4 K, had-asym-int4-g32 z4 V",
                      mean_offset(rotated(lambda x: asym_int4(x, 32, "z4"))), rotated(lambda x: asym_int4(x, 32, "z4")),
                      4.625, 4.625),
            Candidate("mean-had-int4-row K, had-int4-row V", mean_offset(rotated(sym_int4)), rotated(sym_int4),
                      4.25, 4.25),
            Candidate("mean-had-int4-g32 clip K, had-int4-g32 clip V",
                      mean_offset(rotated(lambda x: sym_int4(x, 32, clips=CLIPS))),
                      rotated(lambda x: sym_int4(x, 32, clips=CLIPS)), 4.5, 4.5),
            Candidate("mean-had-int4-row clip K, had-int4-row clip V", mean_offset(rotated(lambda x: sym_int4(x, clips=CLIPS))),
                      rotated(lambda x: sym_int4(x, clips=CLIPS)), 4.25, 4.25),
        ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--text", type=Path, nargs="+", default=[Path("/work/heldout/frankenstein.txt")])
    p.add_argument("--offset", type=int, default=60000)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--only", nargs="*", default=None,
                   help="candidates to run: a substring of the name, or =NAME exactly; float always runs (first)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calibration", type=Path, default=Path("/work/heldout/pride_and_prejudice.txt"),
                   help="text for the pre-RoPE channel factors (pre-cal-*); none: those candidates are left out")
    p.add_argument("--rotation-seed", type=int, default=0,
                   help="0: the plain Sylvester Hadamard; N: random signs (seed N) times it")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    lm = load_model(args.model, device="cpu", dtype="float32")
    calibration = ([lm.bos_id] + lm.encode(excerpt(args.calibration, args.offset))[: args.tokens]
                   if args.calibration and args.calibration.is_file() else None)
    cands = candidates(lm, args.rotation_seed, calibration)
    if args.only:
        def chosen(name: str) -> bool:
            return name == "float" or any(name == o[1:] if o.startswith("=") else o in name for o in args.only)
        cands = [c for c in cands if chosen(c.name)]
    texts = {path.stem: [lm.bos_id] + lm.encode(excerpt(path, args.offset))[: args.tokens] for path in args.text}
    print(f"{args.model}, {args.tokens} tokens from character {args.offset} of {', '.join(texts)}; "
          f"torch {torch.__version__}, {args.threads} thread(s), rotation seed {args.rotation_seed}", flush=True)
    ref: dict[str, float] = {}
    head = "| format | bits/value | vs f16 | " + " | ".join(f"ppl {t} | /float" for t in texts) + " |"
    print(head)
    print("|" + "---|" * (3 + 2 * len(texts)))
    for c in cands:
        start = time.perf_counter()
        cells = []
        for t, ids in texts.items():
            ppl = math.exp(mean_nll(lm, ids, c.k, c.v))
            ref.setdefault(t, ppl)
            cells += [f"{ppl:.2f}", f"{ppl / ref[t]:.3f}"]
        mem = c.bits / 16
        flag = " (over 0.3x)" if mem > 0.3 and c.name != "float" else ""
        note = f"{c.note}, " if c.note else ""
        print(f"| {c.name} | {c.bits:.3f} | {mem:.3f}{flag} | " + " | ".join(cells)
              + f" |  <!-- {note}{time.perf_counter() - start:.0f}s -->", flush=True)


if __name__ == "__main__":
    main()
