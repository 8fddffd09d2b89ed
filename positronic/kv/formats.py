"""4-bit formats for cache rows: INT4 and FP4 (E2M1), eight codes to an int32, one float16
scale per row; and `int4h` (class Int4H, at the end), which meets 1.03x of float's perplexity.

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

import sys

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


def byte_table(levels: torch.Tensor) -> torch.Tensor:
    """[256, 2] float32: the levels of the low and the high nibble of each byte value, for
    `lookup`."""
    nibbles = torch.arange(256)
    return torch.stack([levels[nibbles & 15], levels[nibbles >> 4]], dim=1).float()


def lookup(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """int32 [..., words] -> float32 [..., words * 8]: each code's level, read a byte (two
    codes) at a time from `byte_table(levels)` (on the codes' device). On a little-endian
    machine byte b of word j holds codes 8j + 2b (low nibble) and 8j + 2b + 1; one gather of
    the bytes costs about half of unpacking the nibbles and looking each up."""
    if sys.byteorder != "little":
        return _lookup_nibbles(codes, table)
    pairs = table.index_select(0, codes.contiguous().view(torch.uint8).flatten().long())
    return pairs.view(*codes.shape[:-1], codes.shape[-1] * CODES_PER_WORD)


def _lookup_nibbles(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`lookup` on a big-endian machine: nibble by nibble (the table's first column is the
    level of nibble n at row n, n < 16)."""
    return table[:16, 0].index_select(0, unpack(codes).flatten()).view(
        *codes.shape[:-1], codes.shape[-1] * CODES_PER_WORD)


_ON_DEVICE: dict[tuple[int, torch.device], torch.Tensor] = {}


def on_device(constant: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module-level constant tensor (a level table) on `device`, copied there once: a copy per
    read would be a host-to-device transfer per layer and token on a GPU."""
    key = (id(constant), device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = constant.to(device)
    return _ON_DEVICE[key]


def unpack(codes: torch.Tensor) -> torch.Tensor:
    """int32 [..., words] -> int32 [..., words * 8] in 0..15 (the inverse of `pack`)."""
    nibbles = (codes.unsqueeze(-1) >> _SHIFTS.to(codes.device)) & 15  # arithmetic shift; the mask drops the sign
    return nibbles.reshape(*codes.shape[:-1], codes.shape[-1] * CODES_PER_WORD)  # (not -1: zero rows are ambiguous)


class PackedFormat:
    """What both 4-bit formats share: per-row scales, packing, decoding through a table
    of levels. A subclass gives `name`, `top` (the largest level's magnitude),
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
        """int32 [..., words] -> the levels [..., words * 8] float32 (a table lookup, two codes
        per byte; index_select is the fastest gather on a CPU)."""
        return lookup(codes, on_device(self.byte_levels, codes.device))


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
    byte_levels = byte_table(levels)
    _midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2  # [7]: a magnitude above midpoint i rounds past level i

    def _nibbles(self, scaled: torch.Tensor) -> torch.Tensor:
        index = torch.bucketize(scaled.abs(), self._midpoints.to(scaled.device)).to(torch.int32)
        negative = (scaled < 0) & (index > 0)
        return index | (negative.to(torch.int32) << 3)


def hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix divided by sqrt(n): float32, symmetric, orthogonal
    (H @ H = I), every entry ±1/sqrt(n). n must be a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs head_dim a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


class Int4H:
    """`int4h`: keys stored before RoPE and centred, K and V Hadamard-rotated, asymmetric int4
    per group of 32 values. The codec works on *coded rows* c (what the cache has already made
    of a key or value row, see int4h.Int4HLayer):

        keys:    c = H (R(-p) k - m)      R(p): RoPE to position p, m: the layer's key centre
        values:  c = H v                  H: `hadamard(head_dim)`

    and stores each group g of `group` values of c as 4-bit codes q, a float16 scale s and an
    integer zero point z (0..15, one byte):

        lo = min(g, 0), hi = max(g, 0), s = (hi - lo) / 15 (to float16 toward 0), z = round(-lo / s),
        q = clamp(round(g / s) + z, 0, 15),   decoded (q - z) s

    Error of one round trip, per element of c: at most `half_step` · s, s the stored scale:
    1/2 from rounding (the grid's ends lie within s/2 of lo and hi, so the clamp costs no more),
    plus up to 15 · 2^-10 as float16 rounds the scale down (the grid is then that much narrower
    than hi - lo; scales below float16's normal range, 6·10^-5, lose more). `error_bound`
    carries it through H and RoPE to the rows the model reads.
    Codes pack as for the other formats (code j of a row in bits 4j..4j+3 of word j // 8).
    """

    name = "int4h"
    group = 32
    half_step = 0.5 + 15 * 2**-10 / (1 - 2**-10)
    position_bytes = 8  # the cache keeps each live row's position (int64), once for all layers
    lane_position_bytes = 4  # or, where lanes keep rows of their own, each lane's (int32)
    byte_levels = byte_table(torch.arange(16.0))  # a code's level is the nibble itself

    def groups(self, head_dim: int) -> int:
        """Groups per row (rows narrower than `group` are one group)."""
        return max(1, head_dim // self.group)

    def encode(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Coded rows c [..., head_dim] -> codes int32 [..., head_dim // 8], scales float16 and
        zero points uint8, both [..., groups]."""
        head_dim = c.shape[-1]
        if head_dim % CODES_PER_WORD or head_dim % self.groups(head_dim):
            raise ValueError(f"the {self.name} format packs {CODES_PER_WORD} values per int32 in groups of "
                             f"{self.group}: head_dim {head_dim} does not divide into them")
        g = c.float().reshape(*c.shape[:-1], self.groups(head_dim), -1)
        lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)  # 0 stays on the grid
        exact = ((hi - lo) / 15).clamp(max=FLOAT16_MAX)
        scales = exact.to(torch.float16)
        # rounded toward zero: the grid then spans the whole group and its ends decode to codes
        # 0 and 15, so a decoded row encodes back to the same codes
        scales = torch.where(scales.float() > exact, torch.nextafter(scales, torch.zeros_like(scales)), scales)
        s = scales.float()
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: codes z, decoded 0
        zeros = (-lo / s).round().clamp(0, 15)
        q = ((g / s.unsqueeze(-1)).round() + zeros.unsqueeze(-1)).clamp(0, 15).to(torch.int32)
        return pack(q.reshape(c.shape)), scales, zeros.to(torch.uint8)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        """codes int32 [..., words], scales float16 and zeros uint8 [..., groups] -> coded rows
        float32 [..., words * 8] ((q - z) s is exact in float32)."""
        q = lookup(codes, on_device(self.byte_levels, codes.device)).view(*codes.shape[:-1], scales.shape[-1], -1)
        return ((q - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)).reshape(*codes.shape[:-1], -1)

    def error_bound(self, c: torch.Tensor) -> torch.Tensor:
        """The largest |row - decoded row| per element, for the rows the model reads whose coded
        rows are c [..., head_dim] (the originals, or decoded ones: a decoded group spans at
        least 14/15 of the range its scale was made from): [..., 1] float32.

        Per element of c the error is at most half_step · s_g, s_g <= span / 15; H^T maps an
        error vector e to elements of at most sum|e| / sqrt(head_dim); RoPE mixes two
        elements, at most sqrt(2) times the larger."""
        head_dim = c.shape[-1]
        g = c.float().reshape(*c.shape[:-1], self.groups(head_dim), -1)
        spans = (g.amax(dim=-1).clamp(min=0) - g.amin(dim=-1).clamp(max=0)) * (15 / 14)
        per_element = spans / 15 * self.half_step  # [..., groups]
        return 2**0.5 * g.shape[-1] / head_dim**0.5 * per_element.sum(dim=-1, keepdim=True)

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one stored row takes: codes, a float16 scale and a one-byte zero point per group."""
        return head_dim // CODES_PER_WORD * 4 + 3 * self.groups(head_dim)


PACKED = {fmt.name: fmt for fmt in (Int4(), FP4(), Int4H())}
ROW_SCALED = ("int4", "fp4")  # one scale per row, decoded on their own (PackedSpliceLayer)
FORMATS = ("float", *PACKED)  # float: the model's own dtype, today's SpliceLayer


def check_format(name: str) -> str:
    """`name` if it is a known format, else ValueError listing them."""
    if name not in FORMATS:
        raise ValueError(f"unknown kv format {name!r}; choose from {', '.join(FORMATS)}")
    return name


def packed(name: str) -> "PackedFormat | Int4H | None":
    """The codec of a 4-bit format; None for float (rows stay in the model's dtype)."""
    return PACKED.get(check_format(name))


def bytes_per_token(name: str, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    lanes: int = 0) -> int:
    """Cache bytes one live token takes in format `name`: a K and a V row per layer and kv head
    (float: head_dim values of `dtype`; 4-bit: codes plus scales and zero points), and for
    int4h the row's position: once for all layers, or with `lanes` keeping rows of their own
    (a per-lane policy: SmartKV) each lane's (`lane_position_bytes`)."""
    codec = packed(name)
    row = codec.row_bytes(head_dim) if codec else head_dim * torch.empty((), dtype=dtype).element_size()
    if lanes:
        return 2 * layers * kv_heads * row + lanes * getattr(codec, "lane_position_bytes", 0)
    return 2 * layers * kv_heads * row + getattr(codec, "position_bytes", 0)
