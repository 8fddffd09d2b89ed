"""The fused 4-bit decode kernel (positronic/kv/triton_kernel.py): bit-identical to the torch ops it
replaces, on the views a packed cache hands it. Runs on a CUDA GPU with Triton, or on the CPU
under Triton's interpreter:

    TRITON_INTERPRET=1 PYTHONPATH=DIR_WITH_TRITON python -m pytest tests/positronic/kv/test_triton_kernel.py

Skipped without either (CI has neither: its CPU torch comes without Triton)."""

import pytest
import torch

from positronic import SpliceCache

from positronic.kv import triton_kernel as kv_triton
from positronic.kv.formats import PACKED, ROW_SCALED
from positronic.brain.loop import Brain, BrainConfig
from positronic.models import with_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(kv_triton.triton is None or not (DEVICE == "cuda" or kv_triton.INTERPRETED),
                                reason="needs Triton and a CUDA GPU (or TRITON_INTERPRET=1)")
FORMATS = sorted(ROW_SCALED)  # the kernel decodes the formats with one scale per row


def buffer_views(codec, heads, capacity, start, length, head_dim, seed):
    """Codes and scales as a PackedSpliceLayer holds them on the GPU: rows start .. start +
    length of buffers [1, heads, capacity, ...] (so heads are strided by the capacity)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(2, 1, heads, capacity, head_dim, generator=g) * 10 ** torch.empty(
        2, 1, heads, capacity, 1).uniform_(-2, 2, generator=g)
    codes, scales = codec.encode(rows.to(DEVICE))
    live = slice(start, start + length)
    return codes[0][:, :, live], scales[0][:, :, live], codes[1][:, :, live], scales[1][:, :, live]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("start, length", [(0, 1), (5, 33), (17, 100), (0, 0)])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_fused_decode_equals_the_torch_decode_bit_for_bit(name, dtype, start, length, head_dim):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter casts to bfloat16 by truncation (compiled Triton rounds to nearest, as torch)")
    codec = PACKED[name]
    kc, ks, vc, vs = buffer_views(codec, heads=3, capacity=160, start=start, length=length, head_dim=head_dim,
                                  seed=length + head_dim)
    keys, values = kv_triton.decode_pair(kc, ks, vc, vs, codec.levels, dtype)
    assert keys.shape == values.shape == (1, 3, length, head_dim) and keys.dtype == dtype
    assert torch.equal(keys, codec.decode(kc, ks, dtype)) and torch.equal(values, codec.decode(vc, vs, dtype))


def test_usable_only_when_switched_on_with_a_power_of_two_head_dim(monkeypatch):
    codes = torch.zeros(1, 1, 4, 8, dtype=torch.int32, device=DEVICE)
    assert not kv_triton.usable(codes, 64)  # off by default
    monkeypatch.setenv("POSITRONIC_FUSED_DECODE", "1")
    assert kv_triton.usable(codes, 64) and not kv_triton.usable(codes, 96)
    monkeypatch.setattr(kv_triton, "INTERPRETED", False)
    assert kv_triton.usable(codes, 64) == (DEVICE == "cuda")  # compiled: CUDA tensors only


@pytest.mark.parametrize("name", FORMATS)
def test_a_packed_cache_gives_the_same_logits_fused_or_not(name, monkeypatch):
    from positronic import load_model

    lm = load_model("random:tiny", device=DEVICE, dtype="float32")
    ids = torch.randint(3, lm.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def logits(fused: bool) -> torch.Tensor:
        monkeypatch.setenv("POSITRONIC_FUSED_DECODE", "1" if fused else "0")
        cache = SpliceCache(lm.model.config, kv_format=name)
        with torch.no_grad():
            first = lm.model(input_ids=ids[:, :30], **with_cache(cache), use_cache=True).logits
            then = lm.model(input_ids=ids[:, 30:], **with_cache(cache), use_cache=True).logits
        return torch.cat([first, then], dim=1)

    assert torch.equal(logits(True), logits(False))


@pytest.mark.parametrize("name", FORMATS)
def test_a_brain_runs_4bit_rows_through_the_kernel(name, monkeypatch):
    from positronic import load_model

    lm = load_model("random:tiny", device=DEVICE, dtype="float32")
    calls = []
    kernel = kv_triton.decode_pair
    monkeypatch.setattr(kv_triton, "decode_pair", lambda *args: calls.append(1) or kernel(*args))
    monkeypatch.setenv("POSITRONIC_FUSED_DECODE", "1")
    brain = Brain.start(lm, [lm.bos_id] + list(range(10, 30)), BrainConfig(budget=40, kv_format=name, seed=1))
    for _ in range(60):
        record = brain.step()
        assert not record.rebuilt, record.error
    brain.state.check(deep=True)
    assert calls and brain.counts["culls"] > 0
