"""PackedSpliceLayer: one layer's K/V rows in a 4-bit format (int4, fp4; codecs in formats.py).

The rows' parts (codes and scales) are each held by a SpliceLayer that takes every row edit
with the same arguments, so `SpliceCache(..., kv_format="int4" | "fp4")` edits rows exactly
as the float cache does, and the model reads them decoded.
"""

from __future__ import annotations

import numpy as np
import torch

from . import formats as kv_formats, triton_kernel as kv_triton, rope
from .splice import DEFAULT_CAPACITY, OneSequenceLayer, Scratch, SpliceLayer, check_rows


class PackedSpliceLayer(OneSequenceLayer):
    """One layer's K/V rows in a 4-bit format: codes and one float16 scale per (kv head, row).

    SpliceLayers hold the parts of the rows (here codes and scales; Int4HLayer adds zero
    points), taking every row edit with the same arguments, so their windows are identical
    and row i of one is row i of the others: everything SpliceLayer does to rows (the longest
    run stays put, packing down, growth, the shared scratch) applies unchanged to each part.

        codes:  int32   [1, kv_heads, capacity, head_dim // 8]   (two buffers: keys, values)
        scales: float16 [1, kv_heads, capacity, 1]

    New rows are encoded as they are written; reads (`keys`, `values`, what `update` returns
    to the model's attention) decode the live rows into the model's dtype, fresh each time:
    no float copy is kept, which is the point. So the model attends over decoded rows, the
    newest one included, and a fresh computation quantized the same way gives the same rows.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True
    rotation_rounds = True  # a re-rotated key is decoded, rotated and encoded: rounded again

    def __init__(self, codec, capacity: int = DEFAULT_CAPACITY):
        self.codec = codec
        self.codes = SpliceLayer(capacity)
        self.scales = SpliceLayer(capacity)
        self.dtype: torch.dtype | None = None  # what the model writes and reads back
        self.device: torch.device | None = None
        self.kv_heads = self.head_dim = 0

    @property
    def parts(self) -> list[SpliceLayer]:
        """The SpliceLayers that together hold the rows (each edit goes to all of them)."""
        return [self.codes, self.scales]

    # --- what the model sees ---------------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        return self.codes.is_initialized

    @property
    def length(self) -> int:
        return self.codes.length

    @property
    def start(self) -> int:
        return self.codes.start

    @property
    def capacity(self) -> int:
        return self.codes.capacity

    @property
    def keys(self) -> torch.Tensor | None:
        """Live keys decoded: [1, kv_heads, length, head_dim] in the model's dtype (a new tensor)."""
        return None if not self.is_initialized else self._decode("keys")

    @property
    def values(self) -> torch.Tensor | None:
        """Live values decoded: [1, kv_heads, length, head_dim] in the model's dtype (a new tensor)."""
        return None if not self.is_initialized else self._decode("values")

    def _decode(self, side: str) -> torch.Tensor:
        """The live rows of one side ("keys" or "values") decoded."""
        return self._rows(getattr(self.codes, side), getattr(self.scales, side))

    def _rows(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Codes [..., head_dim // 8] and scales [..., 1] -> rows [..., head_dim] in the model's dtype."""
        return self.codec.decode(codes, scales[..., 0], self.dtype)

    def _decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Live keys and values decoded together (what a forward reads), each [1, kv_heads, length, head_dim]."""
        if kv_triton.usable(self.codes.keys, self.head_dim):  # one fused kernel on a GPU
            return kv_triton.decode_pair(self.codes.keys, self.scales.keys[..., 0], self.codes.values,
                                         self.scales.values[..., 0], self.codec.levels, self.dtype)
        codes = torch.stack([self.codes.keys, self.codes.values])  # [2, 1, kv_heads, length, head_dim // 8]
        scales = torch.stack([self.scales.keys, self.scales.values])[..., 0]
        both = self.codec.decode(codes, scales, self.dtype)
        return both[0], both[1]

    def _encode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """New rows -> (keys, values) of each part, in the order of `parts`."""
        # keys and values in one encode: on a CPU these small ops cost more in per-call
        # overhead than in arithmetic
        codes, scales = self.codec.encode(torch.stack([key_states, value_states]))
        return [(codes[0], codes[1]), (scales[0].unsqueeze(-1), scales[1].unsqueeze(-1))]

    @property
    def _write_rows(self) -> torch.Tensor | None:  # set by SpliceCache.fill, as on a SpliceLayer
        return self.codes._write_rows

    @_write_rows.setter
    def _write_rows(self, rows: torch.Tensor | None) -> None:
        for part in self.parts:
            part._write_rows = rows

    def new_scratches(self) -> list[Scratch]:
        """One scratch per part (each keeps one dtype), in the order of `parts`."""
        return [Scratch() for _ in self.parts]

    def share_scratch(self, *scratches: Scratch) -> None:
        """One scratch per part for every layer (each scratch keeps one dtype), in the order of `parts`."""
        for part, scratch in zip(self.parts, scratches, strict=True):
            part.scratch = scratch

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError(f"SpliceCache holds one sequence; got a batch of {key_states.shape[0]}")
        if key_states.shape[-1] % kv_formats.CODES_PER_WORD:
            raise ValueError(f"the {self.codec.name} format packs {kv_formats.CODES_PER_WORD} values per int32: "
                             f"head_dim {key_states.shape[-1]} is not a multiple of {kv_formats.CODES_PER_WORD}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.kv_heads, self.head_dim = key_states.shape[1], key_states.shape[-1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Encode new rows [1, kv_heads, n, head_dim] and store them where a SpliceLayer would
        (the rows `fill()` named, or after the live rows). Returns the live keys and values,
        decoded."""
        if self.dtype is None:
            self.lazy_initialization(key_states, value_states)
        self._check_rows(key_states, value_states)
        self.write_encoded(self._encode(key_states, value_states))
        return self._decoded()

    def write_encoded(self, encoded: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store rows already encoded: (keys, values) of each part, in the order of `parts`,
        where `update` would (a resumed session's int4h rows)."""
        for part, (keys, values) in zip(self.parts, encoded, strict=True):  # the first checks the fill count
            part.update(keys, values)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def reset(self) -> None:
        """Drop every row; the buffers are kept for reuse."""
        for part in self.parts:
            part.reset()

    def crop(self, tokens_to_remove: int) -> None:
        for part in self.parts:
            part.crop(tokens_to_remove)

    # --- row edits -------------------------------------------------------------------------

    def splice(self, kept: list[tuple[int, int, int]], length: int) -> None:
        """As SpliceLayer.splice: moving a row moves each of its parts."""
        for part in self.parts:
            part.splice(kept, length)

    @classmethod
    def splice_heads(cls, layers: list, kept: list[list[tuple[int, int, int]]], length: int) -> None:
        """As SpliceLayer.splice_heads, on each part of every layer (each part's layers then
        share a Slab of their own)."""
        for index in range(len(layers[0].parts)):
            SpliceLayer.splice_heads([layer.parts[index] for layer in layers], kept, length)

    @classmethod
    def put_lanes(cls, layers: list, lanes: np.ndarray, rows: np.ndarray, keys: torch.Tensor, values: torch.Tensor,
                  positions: np.ndarray | None = None) -> None:
        """As SpliceLayer.put_lanes: keys / values [n, head_dim] encoded, each layer's by that
        layer (`encode_rows`), then every part written. `positions`: what a layer type that
        stores keys before RoPE needs (int4h); here keys are stored as given."""
        heads = layers[0].kv_heads
        encoded = None  # per part: (keys, values) [n, width], in the order of `lanes`
        for index in np.unique(lanes // heads).tolist():
            mine = np.flatnonzero(lanes // heads == index)
            pick = torch.from_numpy(mine).to(keys.device)
            parts = layers[index].encode_rows(lanes[mine] % heads, keys[pick], values[pick],
                                              None if positions is None else positions[mine])
            if encoded is None:
                encoded = [(k.new_empty((len(lanes), k.shape[-1])), v.new_empty((len(lanes), v.shape[-1])))
                           for k, v in parts]
            for (all_keys, all_values), (k, v) in zip(encoded, parts):
                all_keys[pick], all_values[pick] = k, v
        for index, (part_keys, part_values) in enumerate(encoded or []):
            SpliceLayer.put_lanes([layer.parts[index] for layer in layers], lanes, rows, part_keys, part_values)

    @classmethod
    def rows_of(cls, layers: list, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """As SpliceLayer.rows_of, decoded: each part's rows gathered (one gather per part when
        the layers share a Slab), then only those rows decoded (not every live row)."""
        parts = [SpliceLayer.rows_of([layer.parts[index] for layer in layers], rows)
                 for index in range(len(layers[0].parts))]  # per part: keys, values [layers, kv_heads, n, width]
        return layers[0].decode_rows(layers, rows, [k for k, _ in parts], [v for _, v in parts])

    def decode_rows(self, layers: list, rows: np.ndarray, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """Gathered parts of rows `rows` of every layer (`rows_of`) -> keys, values [layers,
        kv_heads, n, head_dim] in the model's dtype."""
        return self._rows(*keys), self._rows(*values)

    def encode_rows(self, heads: np.ndarray, keys: torch.Tensor, values: torch.Tensor,
                    positions: np.ndarray | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rows of kv heads `heads` (int64 [n]) of this layer, keys and values [n, head_dim] ->
        (keys, values) of each part, [n, width]; a row's code does not depend on its head here."""
        return self._encode(keys.to(self.dtype), values.to(self.dtype))

    def rotate_keys(self, first: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Re-rotate the keys of live rows first .. first + rows of cos: decode, rotate in float32
        (rope.rotate), encode again. The new codes carry a fresh rounding error on top of the
        old one (docs/kv_formats.md bounds it)."""
        rows = slice(first, first + cos.shape[-2])  # cos [rows, head_dim], or [kv_heads, rows, head_dim]
        codes, scales = self.codes.keys[:, :, rows], self.scales.keys[:, :, rows]
        rotated = rope.rotate(self.codec.decode(codes, scales[..., 0]), cos, sin)
        new_codes, new_scales = self.codec.encode(rotated)
        codes.copy_(new_codes)  # views of the buffers: written in place
        scales.copy_(new_scales.unsqueeze(-1))

    def memory_bytes(self) -> int:
        """Bytes the parts' buffers hold, spare capacity included (not the scratch)."""
        return sum(part.memory_bytes() for part in self.parts)

    def _check_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_rows(key_states, value_states, self.kv_heads, self.head_dim, self.dtype, self.device)
