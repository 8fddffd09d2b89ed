"""Int4HLayer: one layer's rows in the int4h format, keys stored before RoPE (RowPositions).

`SpliceCache(..., kv_format="int4h")`: the layers share one `RowPositions`, the RoPE position
of every row, which the StateManager sets after each edit (`SpliceCache.set_positions`); a
read rotates each key to its position, so re-rotation is exact. When lanes keep different rows
(a per-lane policy: SmartKV), each kv head of each layer has positions of its own
(`SpliceCache.set_lane_positions`).
"""

from __future__ import annotations

import numpy as np
import torch

from . import formats as kv_formats, rope
from .packed import PackedSpliceLayer
from .splice import SpliceLayer


class RowPositions:
    """The RoPE position of every row of a cache whose layers store keys before RoPE (int4h),
    shared by its layers; the cos/sin of the live rows are computed once per layout and
    reused by every layer.

    Whoever lays rows out sets them (`SpliceCache.set_positions`: StateManager after each edit,
    for the rows a forward is about to write too, before a rebuild and on a resume). A cache
    nobody set them on and that was never spliced is append-only (a user's own `generate`):
    row i is at position i. A splice forgets them: reading or writing rows before they are set
    again is refused.

    Lanes that keep different rows (`set_lanes`) give each lane positions of its own, `lanes`
    int32 [layers, lanes per layer (1 or the kv heads), rows]; `rotation` then answers per layer.
    """

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.tensor: torch.Tensor | None = None  # int64 [rows], on the cache's device
        self.lanes: torch.Tensor | None = None  # int32 [layers, lanes per layer, rows]: per-lane rows (not `tensor`)
        self.stale = False
        self._rotation: tuple | None = None  # (count, device, cos, sin) of the last `rotation`; cleared on set

    def set(self, positions: torch.Tensor) -> None:
        self.tensor, self.lanes, self.stale, self._rotation = positions.to(torch.long), None, False, None

    def set_lanes(self, positions: torch.Tensor) -> None:
        """Lanes hold rows of their own: their positions [layers, lanes per layer, rows] (kept as
        int32: 4 bytes per lane per row)."""
        if positions.dim() != 3:
            raise ValueError(f"lane positions are [layers, lanes per layer, rows], got {list(positions.shape)}")
        self.tensor, self.stale, self._rotation = None, False, None
        self.lanes = positions.to(torch.int32).contiguous()

    def moved(self) -> None:
        """The rows moved (a splice): their positions must be set again before use."""
        self.tensor, self.lanes, self.stale, self._rotation = None, None, True, None

    def reset(self) -> None:
        self.tensor, self.lanes, self.stale, self._rotation = None, None, False, None

    def memory_bytes(self) -> int:
        held = self.tensor if self.lanes is None else self.lanes
        return 0 if held is None else held.numel() * held.element_size()

    def of(self, rows: torch.Tensor) -> torch.Tensor:
        """Positions int64 [n] of rows [n] (int64, on the cache's device)."""
        if self.tensor is None:
            if self.stale:
                raise ValueError("int4h rows were moved: the cache needs their positions (set_positions) "
                                 "before it can read or write them")
            return rows
        if len(rows) and int(rows.max()) >= len(self.tensor):
            raise ValueError(f"row {int(rows.max())} has no position: {len(self.tensor)} were set")
        return self.tensor.to(rows.device)[rows]

    def of_lanes(self, layers: torch.Tensor, heads: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Positions int64 of rows `rows` of kv heads `heads` of layers `layers` (int64 index
        tensors on the CPU, broadcast together; the result on the CPU): each lane's own
        (`set_lanes`; a lane per layer holds one row for all its kv heads), else the rows' shared ones."""
        layers, heads, rows = torch.broadcast_tensors(layers, heads, rows)
        if self.lanes is None:
            return self.of(rows.reshape(-1)).cpu().reshape(rows.shape)
        lane = heads if self.lanes.shape[1] > 1 else torch.zeros_like(heads)
        return self.lanes.cpu()[layers, lane, rows].long()

    def rotation(self, count: int, device: torch.device, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [count, head_dim] float32 that rotate rows 0..count-1 from position 0 to
        theirs (cos, -sin rotate them back: the angles are negated exactly); with lane positions,
        layer `layer`'s, [lanes per layer, count, head_dim] (a lane per layer broadcasts over its
        kv heads). Computed once per layout and count: every layer's reads and writes of a
        forward share it."""
        if self._rotation is None or self._rotation[:2] != (count, device):
            if self.lanes is None:
                positions = self.of(torch.arange(count, device=device)).cpu()
                cos, sin = rope.rotation(self.inv_freq, torch.zeros_like(positions), positions)
            else:
                cos, sin = self._lane_rotation(count)
            self._rotation = (count, device, cos.to(device), sin.to(device))
        if self.lanes is None:
            return self._rotation[2], self._rotation[3]
        return self._rotation[2][layer], self._rotation[3][layer]

    def _lane_rotation(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [layers, lanes per layer, count, head_dim] of every lane's first `count` rows:
        one rotation per distinct position (the lanes share most of theirs), then spread out."""
        if count > self.lanes.shape[-1]:
            raise ValueError(f"row {count - 1} has no position: {self.lanes.shape[-1]} were set per lane")
        held = self.lanes[..., :count].cpu()
        distinct, where = torch.unique(held, return_inverse=True)
        cos, sin = rope.rotation(self.inv_freq, torch.zeros_like(distinct), distinct)  # [distinct, head_dim]
        return cos[where], sin[where]


class Int4HLayer(PackedSpliceLayer):
    """One layer's rows in the int4h format (kv_formats.Int4H): keys un-rotated to position 0
    and centred, K and V Hadamard-rotated, then 4-bit codes with a float16 scale and a zero
    point per group of 32 values.

        codes:  int32   [1, kv_heads, capacity, head_dim // 8]   (keys, values)
        scales: float16 [1, kv_heads, capacity, groups]
        zeros:  uint8   [1, kv_heads, capacity, groups]

    A stored key does not depend on its position: reading rotates it to the position the
    cache's RowPositions give, so re-rotation (`rotate_keys`) is exact — there is nothing to
    do, the new position is read next time. `key_centre` [kv_heads, head_dim] is this layer's
    mean pre-RoPE key (positronic/kv/centres.py; None: zeros, which work less well)."""

    rotation_rounds = False  # keys are stored before RoPE: a re-rotation only changes their positions

    def __init__(self, codec: kv_formats.Int4H, capacity: int, positions: RowPositions,
                 key_centre: torch.Tensor | None, index: int = 0):
        super().__init__(codec, capacity)
        self.zeros = SpliceLayer(capacity)
        self.positions = positions
        self.key_centre = key_centre
        self.index = index  # its layer: where its lanes' positions lie in `positions.lanes`
        # set at the first write, on the rows' device: H [head_dim, head_dim], the centre [1, kv_heads, 1, head_dim]
        self.hadamard: torch.Tensor | None = None
        self.centre: torch.Tensor | None = None

    @classmethod
    def build(cls, config, num_layers: int, capacity: int, key_centres: torch.Tensor | None) -> list["Int4HLayer"]:
        """The layers of a SpliceCache in this format, sharing one RowPositions (the RoPE
        frequencies from `config`); `key_centres` [layers, kv_heads, head_dim] or None."""
        if config is None:
            raise ValueError("the int4h format needs the model config (its RoPE frequencies)")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if head_dim & (head_dim - 1):
            raise ValueError(f"the int4h format rotates rows by a Hadamard matrix: head_dim must be a power of "
                             f"two, this model's is {head_dim} (use int4 or fp4)")
        if key_centres is not None and len(key_centres) != num_layers:
            raise ValueError(f"{len(key_centres)} key centres for {num_layers} layers")
        positions = RowPositions(rope.inv_freq_for_config(config))
        codec = kv_formats.packed("int4h")
        return [cls(codec, capacity, positions, None if key_centres is None else key_centres[i], i)
                for i in range(num_layers)]

    @property
    def parts(self) -> list[SpliceLayer]:
        return [self.codes, self.scales, self.zeros]

    @classmethod
    def splice_all(cls, layers: list, kept: list[tuple[int, int, int]], length: int) -> None:
        super().splice_all(layers, kept, length)
        layers[0].positions.moved()  # shared: the rows' positions must be set again

    @classmethod
    def splice_lanes(cls, layers: list, kept: list[list[tuple[int, int, int]]], length: int) -> None:
        super().splice_lanes(layers, kept, length)
        layers[0].positions.moved()  # each lane's rows moved: their positions are set again per lane

    @classmethod
    def put_lanes(cls, layers: list, lanes: np.ndarray, rows: np.ndarray, keys: torch.Tensor, values: torch.Tensor,
                  positions: np.ndarray | None = None) -> None:
        """As PackedSpliceLayer's, each key first taken back to position 0 from `positions`
        (int64 [n], the position each given key is rotated at; None: its row's, as set)."""
        if positions is None:
            heads = layers[0].kv_heads
            positions = layers[0].positions.of_lanes(torch.from_numpy(lanes // heads), torch.from_numpy(lanes % heads),
                                                     torch.from_numpy(rows)).numpy()
        super().put_lanes(layers, lanes, rows, keys, values, positions)

    def decode_rows(self, layers: list, rows: np.ndarray, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """As PackedSpliceLayer's; each key is turned to its own row's position (its lane's)."""
        count, heads, n = len(layers), self.kv_heads, rows.shape[-1]
        rows = torch.from_numpy(rows.reshape(count, -1, n))  # a lane per layer: one row list for its kv heads
        at = self.positions.of_lanes(torch.arange(count)[:, None, None], torch.arange(heads)[None, :, None], rows)
        cos, sin = rope.rotation(self.positions.inv_freq, torch.zeros(at.numel(), dtype=torch.long), at.reshape(-1))
        centres = torch.cat([layer.centre for layer in layers])  # [layers, kv_heads, 1, head_dim]
        shape = (count, heads, n, -1)
        decoded_keys = rope.rotate(self._uncoded(*keys) + centres, cos.to(self.device).reshape(shape),
                                   sin.to(self.device).reshape(shape))
        return decoded_keys.to(self.dtype), self._uncoded(*values).to(self.dtype)

    def encode_rows(self, heads: np.ndarray, keys: torch.Tensor, values: torch.Tensor,
                    positions: np.ndarray | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rows of this layer's kv heads `heads` (int64 [n]): keys [n, head_dim] rotated at
        `positions` [n], values [n, head_dim] -> (keys, values) of each part, [n, width]."""
        at = torch.from_numpy(np.asarray(positions, dtype=np.int64))
        cos, sin = rope.rotation(self.positions.inv_freq, at, torch.zeros_like(at))  # back to position 0
        centre = self.centre[0, :, 0][torch.from_numpy(heads).to(self.device)]  # [n, head_dim]
        return self._coded(rope.rotate(keys.float(), cos.to(self.device), sin.to(self.device)) - centre, values)

    def reset(self) -> None:
        super().reset()
        self.positions.reset()  # shared by every layer: the first reset clears it, the others find it clear

    # --- what a saved session holds: the parts as stored (decoding and encoding again is not exact here)

    def saved_parts(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        groups = self.codec.groups(head_dim)
        widths = {"codes": (head_dim // kv_formats.CODES_PER_WORD, torch.int32), "scales": (groups, torch.float16),
                  "zeros": (groups, torch.uint8)}  # the order of `parts`
        return {f"{side}_{part}": width for side in ("key", "value") for part, width in widths.items()}

    def saved(self) -> dict[str, torch.Tensor] | None:
        if not self.is_initialized:
            return None
        return {f"{side}_{name}": getattr(part, f"{side}s")
                for side in ("key", "value") for name, part in zip(("codes", "scales", "zeros"), self.parts)}

    def load(self, saved: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        codes = saved["key_codes"]
        heads, head_dim = codes.shape[1], codes.shape[-1] * kv_formats.CODES_PER_WORD
        self.lazy_initialization(torch.empty(1, heads, 0, head_dim, dtype=dtype, device=codes.device), None)
        self.write_encoded([(saved[f"key_{part}"], saved[f"value_{part}"]) for part in ("codes", "scales", "zeros")])

    @classmethod
    def check_saved(cls, saved: dict[str, torch.Tensor]) -> None:
        if not (bool((saved["key_zeros"] <= 15).all() & (saved["value_zeros"] <= 15).all())
                and bool((saved["key_scales"] >= 0).all() & (saved["value_scales"] >= 0).all())):
            raise ValueError("saved int4h zero points must lie in 0..15 and scales be >= 0")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.hadamard = kv_formats.hadamard(self.head_dim).to(self.device)
        centre = torch.zeros(self.kv_heads, self.head_dim) if self.key_centre is None else self.key_centre
        if tuple(centre.shape) != (self.kv_heads, self.head_dim):
            raise ValueError(f"the int4h key centre is {tuple(centre.shape)}; this layer's keys are "
                             f"({self.kv_heads}, {self.head_dim}) per row")
        self.centre = centre.to(self.device, torch.float32)[None, :, None, :]

    def _coded(self, plain: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys at position 0 less the centre and values, each [..., head_dim] -> (keys, values)
        of each part (H, then 4-bit codes per group)."""
        codes, scales, zeros = self.codec.encode(torch.stack([plain, values.float()]) @ self.hadamard)
        return [(codes[0], codes[1]), (scales[0], scales[1]), (zeros[0], zeros[1])]

    def _uncoded(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        """One side's parts -> what `_coded` was given (keys at position 0 less the centre, or
        values), as stored: float32 [..., head_dim]."""
        return self.codec.decode(codes, scales, zeros) @ self.hadamard  # H^T = H

    def _decode(self, side: str) -> torch.Tensor:
        rows = self._uncoded(getattr(self.codes, side), getattr(self.scales, side), getattr(self.zeros, side))
        if side == "keys":
            cos, sin = self.positions.rotation(self.length, self.device, self.index)
            rows = rope.rotate(rows + self.centre, cos, sin)
        return rows.to(self.dtype)

    def _decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode("keys"), self._decode("values")

    def _encode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        count = key_states.shape[2]
        if self._write_rows is not None:  # into gaps of the live rows
            rows, length = self._write_rows.to(self.device), self.length
        else:  # appended: the live rows after this write are the ones the read will rotate
            rows, length = torch.arange(self.length, self.length + count, device=self.device), self.length + count
        cos, sin = self.positions.rotation(length, self.device, self.index)  # shared rows: the same for every layer
        plain = rope.rotate(key_states.float(), cos[..., rows, :], -sin[..., rows, :]) - self.centre  # to position 0
        return self._coded(plain, value_states)

    def coded_keys(self, keys: torch.Tensor, positions: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """What this layer would make of keys [1, kv_heads, n, head_dim] at `positions` [n]
        before quantizing them (c = H (R(-p) k - m)): for error bounds (Int4H.error_bound).
        `head`: the keys are that kv head's alone, [1, 1, n, head_dim]."""
        cos, sin = rope.rotation(self.positions.inv_freq, positions.cpu(), torch.zeros_like(positions.cpu()))
        centre = self.centre if head is None else self.centre[:, head : head + 1]
        return (rope.rotate(keys.float(), cos, sin) - centre) @ self.hadamard

    def coded_values(self, values: torch.Tensor) -> torch.Tensor:
        """c = H v for values [1, kv_heads, n, head_dim]."""
        return values.float() @ self.hadamard

    def rotate_keys(self, first: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Nothing to do: keys are stored before RoPE, and a read rotates them to the
        positions set after the move (exact)."""
