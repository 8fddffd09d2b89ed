"""RoPE re-rotation (positronic/kv/rope.py): a key stored at one position, moved to another
without a forward, is the key the model itself writes at the new position."""

import pytest
import torch

from positronic.kv import rope


def inv_freq(lm) -> torch.Tensor:
    return lm.model.model.rotary_emb.inv_freq


def test_moving_stored_keys_gives_the_keys_a_plain_prefill_writes_at_the_new_positions(tiny, layer0_oracle):
    ids = [tiny.bos_id] + tiny.encode("move these keys")
    old = list(range(len(ids)))
    new = [p * 3 + 7 for p in old]  # every key moves by a different amount
    stored, _ = layer0_oracle(tiny, ids, old)
    fresh, _ = layer0_oracle(tiny, ids, new)
    cos, sin = rope.rotation(inv_freq(tiny), torch.tensor(old), torch.tensor(new))
    assert cos.shape == sin.shape == (len(ids), tiny.head_dim) and cos.dtype == torch.float32
    moved = rope.rotate(stored, cos, sin)
    torch.testing.assert_close(moved, fresh, rtol=0, atol=1e-5)
    assert (stored - fresh).abs().max() > 1e-2, "the move is not a no-op"


def test_a_key_moved_near_position_8192_matches_one_computed_there(tiny, layer0_oracle):
    ids = [tiny.bos_id] + tiny.encode("far")
    old = [0, 1, 2, 3][:len(ids)]
    new = [8190, 8191, 8192, 8193][:len(ids)]
    stored, _ = layer0_oracle(tiny, ids, old)
    fresh, _ = layer0_oracle(tiny, ids, new)
    moved = rope.rotate(stored, *rope.rotation(inv_freq(tiny), torch.tensor(old), torch.tensor(new)))
    torch.testing.assert_close(moved, fresh, rtol=0, atol=1e-4)


def test_a_move_to_the_same_position_is_the_identity_and_moves_compose(tiny):
    keys = torch.randn(1, tiny.num_kv_heads, 5, tiny.head_dim)
    p = torch.tensor([0, 4, 9, 100, 2000])
    cos, sin = rope.rotation(inv_freq(tiny), p, p)
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
    assert torch.equal(rope.rotate(keys, cos, sin), keys)
    q, r = p + 13, p + 40
    twice = rope.rotate(rope.rotate(keys, *rope.rotation(inv_freq(tiny), p, q)), *rope.rotation(inv_freq(tiny), q, r))
    once = rope.rotate(keys, *rope.rotation(inv_freq(tiny), p, r))
    torch.testing.assert_close(twice, once, rtol=0, atol=1e-5)
    back = rope.rotate(once, *rope.rotation(inv_freq(tiny), r, p))
    torch.testing.assert_close(back, keys, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keys_are_rotated_in_float32_and_come_back_in_their_dtype(tiny, dtype):
    keys = torch.randn(1, tiny.num_kv_heads, 4, tiny.head_dim)
    cos, sin = rope.rotation(inv_freq(tiny), torch.arange(4), torch.arange(4) + 500)
    moved = rope.rotate(keys.to(dtype), cos, sin)
    assert moved.dtype == dtype
    assert torch.equal(moved, rope.rotate(keys.to(dtype).float(), cos, sin).to(dtype)), "one rounding, at the end"


def test_angles_are_the_float32_products_transformers_uses(tiny):
    positions = torch.tensor([0, 1, 8191])
    got = rope.angles(inv_freq(tiny), positions)
    assert got.dtype == torch.float32 and got.shape == (3, tiny.head_dim // 2)
    cos, _ = tiny.model.model.rotary_emb(torch.zeros(1, 3, 1), positions[None])
    torch.testing.assert_close(torch.cat([got, got], -1).cos(), cos[0].float(), rtol=0, atol=1e-6)
