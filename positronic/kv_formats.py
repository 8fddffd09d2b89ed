"""4-bit formats for cache rows: INT4 and FP4 (E2M1), eight codes to an int32, one float16
scale per row.

A *row* is one (layer, kv head, position) vector of `head_dim` keys or values. Each format
maps a row x to codes and a scale so that x ≈ level(code) · scale:

    INT4  levels -8 .. 7                         scale = max|x| / 7
    FP4   levels 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6   scale = max|x| / 6   (E2M1: sign, 2-bit
          exponent, 1-bit mantissa; the nibble is sign << 3 | magnitude index)

Storage: code j of a row sits in bits 4j .. 4j + 3 (mod 32) of int32 word j // 8, so a
row of head_dim values takes head_dim / 2 bytes plus the 2-byte scale: 34 bytes for
head_dim 64, against 128 in float16 and 256 in float32.

Error of one round trip, per element (s = the stored float16 scale):
    INT4  |x - decode| <= s / 2         (rounding to the nearest integer level)
    FP4   the nearest level: |x - decode| <= s (the widest gap, 4 .. 6, is 2 levels wide)
The largest element of a row always decodes to ±top · s (the scale is made from it), so
`scale = max|decoded row| / top`: the bound can be read off a decoded row as well
(`error_bound`).

Only plain torch ops: this runs wherever the model runs, CPU included.
"""

from __future__ import annotations

import torch

CODES_PER_WORD = 8  # 4-bit codes in one int32
FLOAT16_MAX = 65504.0
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # bit offset of code j within its word


def pack(nibbles: torch.Tensor) -> torch.Tensor:
    """int32 [..., head_dim] holding 0..15 -> int32 [..., head_dim // 8], code j of each
    group of eight in bits 4j..4j+3. The fields do not overlap, so their sum is their OR
    (the top nibble lands in the sign bit; int32 arithmetic wraps, nothing overflows)."""
    groups = nibbles.reshape(*nibbles.shape[:-1], nibbles.shape[-1] // CODES_PER_WORD, CODES_PER_WORD)
    return (groups << _SHIFTS.to(nibbles.device)).sum(dim=-1, dtype=torch.int32)


def unpack(codes: torch.Tensor) -> torch.Tensor:
    """int32 [..., words] -> int32 [..., words * 8] in 0..15 (the inverse of `pack`)."""
    nibbles = (codes.unsqueeze(-1) >> _SHIFTS.to(codes.device)) & 15  # arithmetic shift; the mask drops the sign
    return nibbles.reshape(*codes.shape[:-1], codes.shape[-1] * CODES_PER_WORD)  # (not -1: zero rows are ambiguous)


class PackedFormat:
    """What both 4-bit formats share: per-row scales, packing, decoding through a 16-entry
    table of levels. A subclass gives `name`, `top` (the largest level's magnitude),
    `half_step` (the worst rounding error, in units of the scale), `levels` (the value of
    each nibble 0..15) and `_nibbles` (scaled values -> nearest level's nibble)."""

    name: str
    top: float
    half_step: float
    levels: torch.Tensor  # [16] float32: nibble -> level

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., head_dim] (any float dtype, head_dim a multiple of 8) ->
        codes int32 [..., head_dim // 8], scales float16 [...]."""
        if x.shape[-1] % CODES_PER_WORD:
            raise ValueError(f"a 4-bit format packs {CODES_PER_WORD} values per int32: head_dim {x.shape[-1]} "
                             f"is not a multiple of {CODES_PER_WORD}")
        x = x.float().contiguous()  # the model hands over transposed views
        # float16 cannot hold a scale above 65504 (rows beyond 65504 * top clip); a row of
        # zeros gets scale 0 and codes 0, which decode to zeros
        scales = (x.abs().amax(dim=-1) / self.top).clamp(max=FLOAT16_MAX).to(torch.float16)
        exact = scales.float()  # codes are chosen against the scale that decoding will use
        scaled = x / torch.where(exact > 0, exact, torch.ones_like(exact)).unsqueeze(-1)
        return pack(self._nibbles(scaled)), scales

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """codes int32 [..., words], scales float16 [...] -> [..., words * 8] in `dtype`
        (computed in float32: level · scale is exact there, so a float32 decode re-encodes
        to the same codes and scale)."""
        return (self._levels_of(codes) * scales.float().unsqueeze(-1)).to(dtype)

    def error_bound(self, rows: torch.Tensor) -> torch.Tensor:
        """The largest |x - decode(encode(x))| for rows [..., head_dim] (originals or decoded
        ones: both have the same max|row|), per row: [..., 1] float32."""
        return rows.float().abs().amax(dim=-1, keepdim=True) / self.top * self.half_step

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one stored row takes: its codes and its float16 scale."""
        return head_dim // CODES_PER_WORD * 4 + 2

    def _nibbles(self, scaled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _levels_of(self, codes: torch.Tensor) -> torch.Tensor:
        """int32 [..., words] -> the levels [..., words * 8] float32 (a 16-entry table lookup;
        index_select is the fastest gather on a CPU)."""
        nibbles = unpack(codes)
        return self.levels.to(codes.device).index_select(0, nibbles.flatten()).view(nibbles.shape)


class Int4(PackedFormat):
    """Symmetric INT4: codes -8 .. 7 in two's complement, scale = max|row| / 7 (so -8 is never
    used: the grid stays symmetric). Rounds half to even."""

    name = "int4"
    top = 7.0
    half_step = 0.5
    levels = torch.tensor([float(n) for n in range(8)] + [float(n - 16) for n in range(8, 16)])

    def _nibbles(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().clamp(-8, 7).to(torch.int32) & 15

    def _levels_of(self, codes: torch.Tensor) -> torch.Tensor:
        # the level is the nibble read as a signed number: shift it to the top of the word and
        # back (arithmetic shift), which sign-extends it; twice as fast as the table on a CPU
        signed = (codes.unsqueeze(-1) << (28 - _SHIFTS.to(codes.device))) >> 28
        return signed.reshape(*codes.shape[:-1], codes.shape[-1] * CODES_PER_WORD).float()


class FP4(PackedFormat):
    """FP4 E2M1: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, scale = max|row| / 6.
    A value goes to the nearest magnitude (a tie to the smaller one); nibble = sign << 3 |
    index, with the sign set only on a nonzero magnitude (no -0 code: a decoded row encodes
    back to the same codes)."""

    name = "fp4"
    top = 6.0
    half_step = 1.0  # half of the widest gap, 4 .. 6
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    levels = torch.cat([magnitudes, -magnitudes])
    _midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2  # [7]: a magnitude above midpoint i rounds past level i

    def _nibbles(self, scaled: torch.Tensor) -> torch.Tensor:
        index = torch.bucketize(scaled.abs(), self._midpoints.to(scaled.device)).to(torch.int32)
        negative = (scaled < 0) & (index > 0)
        return index | (negative.to(torch.int32) << 3)


PACKED = {fmt.name: fmt for fmt in (Int4(), FP4())}
FORMATS = ("float", *PACKED)  # float: the model's own dtype, today's SpliceLayer


def check_format(name: str) -> str:
    """`name` if it is a known format, else ValueError listing them."""
    if name not in FORMATS:
        raise ValueError(f"unknown kv format {name!r}; choose from {', '.join(FORMATS)}")
    return name


def packed(name: str) -> PackedFormat | None:
    """The codec of a 4-bit format; None for float (rows stay in the model's dtype)."""
    return PACKED.get(check_format(name))


def bytes_per_token(name: str, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Cache bytes one live token takes in format `name`: a K and a V row per layer and kv head
    (float: head_dim values of `dtype`; 4-bit: codes plus a float16 scale)."""
    codec = packed(name)
    row = codec.row_bytes(head_dim) if codec else head_dim * torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * row
