"""RowTiles: a GPU half-precision model's row-wise layers run every product and norm over the
same 64 rows whatever the row count (so the kernel, hence a row's bits, cannot change with how
many sequences share a forward), and give the layers' own numbers. The GPU's proof, batched
float16 sequences choosing alone's tokens, is in tests/test_cuda.py; here the mechanism, on
the CPU, in the real families' classes."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from positronic.models import load_model, random_config
from positronic.models.tiles import LIMIT, TILE, RowTiles, row_wise, tiled, use_row_tiles


class Rows(torch.overrides.TorchFunctionMode):
    """Records the row count (all dims but the last) of every linear product's and every
    mean's input: the products and the norms' reductions a forward makes."""

    def __init__(self):
        super().__init__()
        self.linear, self.mean = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.linear.append(args[0].numel() // args[0].shape[-1])
        elif func in (torch.Tensor.mean, torch.mean):
            self.mean.append(args[0].numel() // args[0].shape[-1])
        return func(*args, **(kwargs or {}))


def model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    config = random_config(family)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["tiny", "qwen3"])
def test_every_product_and_norm_runs_over_one_tile_whatever_the_rows(family):
    """1, 5, 64 and 70 tokens (a sequence alone, a batched round, a prompt chunk beside other
    rows): every linear product and every norm's mean sees TILE rows; untiled, they see the
    tokens (so this fails without the tiles). Qwen3's per-head q/k norms are tiled too."""
    plain = model(family)
    layers = use_row_tiles(tiledmodel := model(family))
    config = plain.config
    linears = sum(type(m) is nn.Linear for m in plain.modules())
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in plain.modules())
    assert layers == linears + norms and norms >= 2 * config.num_hidden_layers + 1
    for tokens in (1, 5, 64, 70):
        ids = torch.randint(3, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad(), Rows() as seen:
            got = tiledmodel(ids).logits
        assert seen.linear and set(seen.linear) == {TILE}, tokens
        assert seen.mean and set(seen.mean) == {TILE}, tokens
        with torch.no_grad(), Rows() as untiled:
            want = plain(ids).logits
        assert tokens in untiled.linear  # what the tiles change
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_rows_output_is_its_own_alone_and_among_others():
    """Row k of a tiled linear layer and norm: the same bits alone, among 32 rows, and in a
    70-row chunk (two tiles) at another place."""
    torch.manual_seed(3)
    layer, norm = nn.Linear(96, 160), nn.RMSNorm(96, eps=1e-6)
    use_row_tiles(layer)
    use_row_tiles(norm)
    x = torch.randn(70, 96)
    with torch.no_grad():
        for module in (layer, norm):
            alone = torch.cat([module(x[None, k : k + 1])[0] for k in range(70)])
            assert torch.equal(module(x[None, :32])[0], alone[:32])
            assert torch.equal(module(x.flip(0))[-1], alone[0])  # row 0 last, in the second tile
            assert module(x[:0]).shape == (0, module(x[:1]).shape[-1])  # no rows: no tiles


def test_past_the_limit_one_plain_call_and_autograd_stays_the_layers_own():
    layer = nn.Linear(8, 4)
    use_row_tiles(layer)
    x = torch.randn(LIMIT + 1, 8)
    with torch.no_grad(), Rows() as seen:
        layer(x)
    assert seen.linear == [LIMIT + 1]
    with Rows() as seen:  # a product autograd follows: the layer's own, in one call
        layer(torch.randn(3, 8, requires_grad=True)).sum().backward()
    assert seen.linear == [3] and layer.weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(layer.untiled(x[:3]), F.linear(x[:3], layer.weight, layer.bias))


def test_only_layers_that_treat_each_vector_alone_are_tiled():
    class GatedRMSNorm(nn.Module):  # two inputs: not one row at a time of one input
        def forward(self, x, gate):
            return x * gate

    class GatedNormRMSNorm(GatedRMSNorm):
        pass

    assert row_wise(nn.Linear(2, 2)) and row_wise(nn.RMSNorm(2)) and row_wise(nn.LayerNorm(2))
    assert not row_wise(nn.Embedding(4, 2)) and not row_wise(GatedNormRMSNorm())
    assert not row_wise(nn.Sequential(nn.Linear(2, 2)))
    assert tiled(nn.Linear) is tiled(nn.Linear) and issubclass(tiled(nn.Linear), (RowTiles, nn.Linear))
    layer = nn.Linear(2, 3)
    weight = layer.weight
    use_row_tiles(layer)
    assert layer.weight is weight and set(layer.state_dict()) == {"weight", "bias"}
    assert not row_wise(layer)  # tiled once: not again


def test_the_loader_tiles_only_a_gpus_half_precision_layers():
    """A CPU model keeps its own layers (float32: RowInvariantLinear; other dtypes torch's)."""
    for dtype in ("float32", "bfloat16"):
        lm = load_model("random:tiny", device="cpu", dtype=dtype)
        assert not any(isinstance(m, RowTiles) for m in lm.model.modules()), dtype
