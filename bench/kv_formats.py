"""What the 4-bit cache formats save and what they cost.

    python bench/kv_formats.py [--model smollm2] [--shapes smollm2 random:tinyllama] [--text FILE]
                               [--tokens 256] [--rotations 1 2 4 8]

1. Cache bytes per token for each model shape and format (float32, float16, int4, fp4) and
   the ratio to float16: kv_formats.bytes_per_token from the shape (a `random:` shape needs no
   weights: models.RANDOM_SHAPES), and for --model the buffers of a StateManager holding
   --tokens rows of the text (memory_bytes over its capacity; the tests check that the buffers
   match the formula for both shapes).
2. The error of one round trip on --model's real keys and values (a float prefill of the
   first --tokens tokens of --text, every layer): max |error| in units of the format's bound
   (h·s: INT4 s/2, FP4 s), max |error| / max|row|, and the relative RMS error.
3. Re-rotation: keys moved by one position r times (decode, rotate, encode each time)
   against the exact rotation of the float keys: max |error| in rounding bounds of the final
   scale (the deep check allows 2^(r+1) - 1), relative RMS error; and the time to re-rotate
   every layer's keys, float (rope.rotate) against 4-bit (decode, rotate, encode: what
   PackedSpliceLayer.rotate_keys does).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic import StateManager, load_model

from positronic.kv import rope  # noqa: E402
from positronic.evaluate import DEFAULT_TEXT, read_text  # noqa: E402
from positronic.kv.formats import PACKED, bytes_per_token  # noqa: E402
from positronic.models import RANDOM_SHAPES  # noqa: E402


def shape_of(name: str, lm=None) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a model: a random shape from its table, else the loaded model's."""
    if name.startswith("random:"):
        s = RANDOM_SHAPES[name.removeprefix("random:")]
        return s["num_hidden_layers"], s["num_key_value_heads"], s["hidden_size"] // s["num_attention_heads"]
    lm = lm or load_model(name, device="cpu", dtype="float32")
    return lm.num_layers, lm.num_kv_heads, lm.head_dim


def held_per_row(lm, ids: list[int], fmt: str) -> float:
    """memory_bytes of a StateManager prefilled with `ids` in format `fmt`, per row of capacity
    (nothing else held: no overlapping move has used the scratch)."""
    sm = StateManager.from_tokens(lm, ids, capacity=len(ids), kv_format=fmt)
    return sm.memory_bytes() / len(ids)


def rerotate_ms(codec, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, repeats: int = 5) -> float:
    """Milliseconds to re-rotate keys [layers, kv_heads, rows, head_dim] layer by layer, as the
    cache does: rope.rotate on float rows (codec None), else decode, rotate, encode."""
    stored = [codec.encode(layer) for layer in keys] if codec else list(keys)

    def once():
        for item in stored:
            if codec:
                codec.encode(rope.rotate(codec.decode(*item), cos, sin))
            else:
                rope.rotate(item, cos, sin)

    once()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - start) / repeats * 1000


def round_trip(codec, rows: torch.Tensor) -> tuple[float, float, float]:
    """rows [..., head_dim]: (max error / bound, max error / max|row|, RMS error / RMS)."""
    decoded = codec.decode(*codec.encode(rows))
    error = (decoded - rows).abs()
    return (float((error / codec.error_bound(decoded).clamp_min(1e-30)).max()),
            float((error / rows.abs().amax(-1, keepdim=True).clamp_min(1e-30)).max()),
            float(error.pow(2).mean().sqrt() / rows.pow(2).mean().sqrt()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="the model whose real K/V are measured")
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "random:tinyllama"])
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rotations", nargs="+", type=int, default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    lm = load_model(args.model, device="cpu", dtype="float32")

    body, title = read_text(args.text)
    ids = [lm.bos_id] + lm.encode(body)[: args.tokens - 1]
    print("1. cache bytes per token (K and V, every layer)")
    print(f"{'model':<28} {'float32':>9} {'float16':>9} {'int4':>9} {'fp4':>9} {'int4/f16':>9}")
    for name in args.shapes:
        layers, kv_heads, head_dim = shape_of(name, lm if name == args.model else None)
        sizes = [bytes_per_token(fmt, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
                 for fmt, dtype in (("float", torch.float32), ("float", torch.float16), ("int4", torch.float32),
                                    ("fp4", torch.float32))]
        print(f"{name:<28} " + " ".join(f"{s:>9.0f}" for s in sizes) + f" {sizes[2] / sizes[1]:>9.4f}")
    held = [held_per_row(lm, ids, fmt) for fmt in ("float", "int4", "fp4")]
    print(f"{lm.name + ' buffers (' + str(lm.dtype).removeprefix('torch.') + ')':<28} {held[0]:>9.0f} {'-':>9} "
          f"{held[1]:>9.0f} {held[2]:>9.0f}")

    state = StateManager.from_tokens(lm, ids)
    pairs = [state.layer_kv(index) for index in range(lm.num_layers)]
    keys = torch.cat([k for k, _ in pairs])  # [layers, kv_heads, rows, head_dim]
    values = torch.cat([v for _, v in pairs])
    print(f"\n2. one round trip on {lm.name}'s keys and values ({title}, {len(ids)} tokens, all {lm.num_layers} layers)")
    print(f"{'format':<8} {'K err/bound':>11} {'K err/max':>10} {'K rel RMS':>10} {'V err/bound':>11} "
          f"{'V err/max':>10} {'V rel RMS':>10}")
    for name, codec in PACKED.items():
        cells = round_trip(codec, keys) + round_trip(codec, values)
        print(f"{name:<8} " + " ".join(f"{c:>10.4f}" if i % 3 else f"{c:>11.3f}" for i, c in enumerate(cells)))

    print("\n3. re-rotation by +1 position, r times (decode, rotate, encode), against the exact float rotation")
    print(f"{'format':<8} {'r':>3} {'err/bound':>10} {'err/max':>9} {'rel RMS':>9}")
    positions = torch.arange(len(ids))
    for name, codec in PACKED.items():
        for r in args.rotations:
            moved = codec.decode(*codec.encode(keys))
            exact = keys
            for step in range(r):
                cos, sin = rope.rotation(lm.inv_freq, positions + step, positions + step + 1)
                moved = codec.decode(*codec.encode(rope.rotate(moved, cos, sin)))
                exact = rope.rotate(exact, cos, sin)
            error = (moved - exact).abs()
            print(f"{name:<8} {r:>3} {float((error / codec.error_bound(moved)).max()):>10.3f} "
                  f"{float((error / exact.abs().amax(-1, keepdim=True)).max()):>9.4f} "
                  f"{float(error.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()):>9.4f}")
    cos, sin = rope.rotation(lm.inv_freq, positions, positions + 1)
    for fmt in ("float", *PACKED):
        ms = rerotate_ms(PACKED.get(fmt), keys, cos, sin)
        print(f"re-rotating {len(ids)} keys x {lm.num_layers} layers, {fmt}: {ms:.1f} ms "
              f"({1000 * ms / len(ids):.0f} µs per row of every layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
