"""The tiled int8-weight-only kernel for a prompt's rows (positronic/models/blocked.py): the one-row
loop's bits, or the loop itself."""

import logging

import pytest
import torch
from torch import nn

from positronic.models import weight_only as blocked
from positronic.models.weight_only import _PRODUCT, WeightOnlyInt8Linear


@pytest.fixture(scope="module")
def kernel():
    built = blocked.compiled_kernel()
    assert built is not None, "the tiled kernel did not build here (inductor's C++ builder: see the log)"
    return built


# (out, in): SmolLM2's kv projection; an input that is no multiple of the 16 lanes (a tail);
# fewer outputs than a tile; an odd count of both
SHAPES = [(192, 576), (64, 100), (3, 48), (37, 77)]


@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_the_tiles_give_every_row_the_loops_bits(kernel, out_features, in_features):
    torch.manual_seed(out_features + in_features)
    values = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    scale = torch.rand(out_features) / 127
    x = torch.randn(67, in_features) * torch.rand(67, 1) * 10
    x[5] = 0.0
    x[6] = -0.0
    x[7, 1] = float("nan")
    x[8, 2] = float("inf")
    loop = torch.cat([_PRODUCT(row[None], values, scale) for row in x])  # each row alone, as a decode step
    for rows in (2, 3, 4, 5, 6, 7, 8, 13, 67):
        assert blocked.same_bits(blocked.tiled(x[:rows], values, scale), loop[:rows]), rows
    assert loop[7].isnan().any() and blocked.same_bits(blocked.tiled(x[7:11], values, scale), loop[7:11])


def test_a_prompt_chunk_through_a_layer_takes_the_tiles_and_a_lone_row_the_loop(kernel, monkeypatch):
    monkeypatch.setattr(blocked, "_agrees", {})
    torch.manual_seed(0)
    layer = WeightOnlyInt8Linear.from_linear(nn.Linear(80, 48))
    x = torch.randn(30, 80)
    layer(x[:1])
    assert blocked._agrees == {}
    chunk = layer(x)
    assert blocked._agrees == {(48, 80): True}
    assert torch.equal(chunk, torch.cat([layer(row[None]) for row in x]))


def test_a_shape_whose_tiles_differ_from_the_loop_keeps_the_loop_and_says_so(kernel, monkeypatch, caplog):
    monkeypatch.setattr(blocked, "_agrees", {})
    torch.manual_seed(1)
    values = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    scale = torch.rand(16)

    def other_loop(x, values, scale):  # a loop that adds in another order: different last bits
        return (x.double() @ values.double().t() * scale.double()).float() + 1e-3

    x = torch.randn(6, 32)
    with caplog.at_level(logging.WARNING, logger=blocked.__name__):
        assert torch.equal(blocked.product(x, values, scale, other_loop), other_loop(x, values, scale))
    assert blocked._agrees == {(16, 32): False} and "keep the loop" in caplog.text
    assert torch.equal(blocked.product(x, values, scale, other_loop), other_loop(x, values, scale))


def test_under_an_op_counter_the_layer_runs_eagerly_to_the_loops_numbers():
    """A dispatch mode (bench/rounds.py's op counter) compiles nothing: the layer's expression
    runs eagerly there, a block of outputs at a time, instead of failing."""
    from positronic.util import TorchOps

    torch.manual_seed(2)
    layer = WeightOnlyInt8Linear.from_linear(nn.Linear(64, 600))
    x = torch.randn(5, 64)
    with TorchOps() as ops:
        counted = layer(x)
    assert ops.count > 0 and counted.shape == (5, 600)
    torch.testing.assert_close(counted, layer(x), rtol=1e-5, atol=1e-5)
