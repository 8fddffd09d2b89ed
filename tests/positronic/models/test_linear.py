"""RowInvariantLinear: a CPU model's linear layers give nn.Linear's numbers, and each row the
same bits whatever rows come with it (what makes a batched tick equal its sequences alone)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from positronic.models.linear import ONEDNN, PACKS, RowInvariantLinear, use_row_invariant_linear

pytestmark = pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear (the layers stay torch's own)")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 8, 64, 300])
def test_every_row_count_gives_nn_linears_numbers(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(96, 160, bias=bias)
    want = F.linear(x := torch.randn(1, rows, 96), layer.weight, layer.bias)
    assert use_row_invariant_linear(layer) == 1 and type(layer) is RowInvariantLinear
    with torch.no_grad():
        got = layer(x)
    assert got.shape == (1, rows, 160) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_gets_the_same_bits_alone_and_among_any_other_rows(bias):
    """One row, two, a batch of eight, a prompt chunk of 64: row k's output is the same."""
    torch.manual_seed(5)
    layer = nn.Linear(576, 1536, bias=bias)
    use_row_invariant_linear(layer)
    x = torch.randn(64, 576)
    with torch.no_grad():
        alone = torch.cat([layer(x[k : k + 1]) for k in range(64)])
        for rows in (2, 3, 8, 64):
            assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
        others = torch.randn(7, 576)  # other sequences' rows, before and after
        assert torch.equal(layer(torch.cat([others[:3], x[:1], others[3:]]))[3], alone[0])
        assert torch.equal(layer(x[None, :5]), alone[None, :5])  # [1, rows, in], as a model feeds it
        threads = torch.get_num_threads()
        try:  # a batch's forward and a sequence's own run in threads with other thread counts
            for count in (1, 4):
                torch.set_num_threads(count)
                assert torch.equal(layer(x[:8]), alone[:8]), f"{count} threads"
        finally:
            torch.set_num_threads(threads)


def test_products_autograd_follows_and_other_dtypes_stay_torchs_own():
    torch.manual_seed(2)
    layer = nn.Linear(32, 48)
    use_row_invariant_linear(layer)
    x = torch.randn(3, 32, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    half = layer.to(torch.bfloat16)
    with torch.no_grad():
        y = torch.randn(3, 32, dtype=torch.bfloat16)
        assert torch.equal(half(y), F.linear(y, half.weight, half.bias))


def test_a_cpu_model_has_them_with_its_tied_head_still_tied(tiny):
    linears = [m for m in tiny.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is RowInvariantLinear for m in linears)
    head, embed = tiny.model.get_output_embeddings(), tiny.model.get_input_embeddings()
    if tiny.model.config.tie_word_embeddings:
        assert head.weight is embed.weight
    assert use_row_invariant_linear(tiny.model) == 0, "a second pass finds nothing left to change"


def test_a_batch_of_rows_through_the_model_matches_one_row_at_a_time(tiny):
    """What a batched tick relies on: eight tokens fed as eight rows give each one's logits as
    fed alone, bit for bit (same positions, no cache)."""
    ids = torch.tensor([[tiny.bos_id, 5, 9, 11, 40, 41, 7, 3]])
    with torch.inference_mode():
        rows = tiny.model(input_ids=ids.T, position_ids=torch.zeros_like(ids.T)).logits[:, 0]  # 8 sequences of 1
        alone = torch.cat([tiny.model(input_ids=ids[:, k : k + 1], position_ids=torch.zeros((1, 1), dtype=torch.long))
                           .logits[0] for k in range(ids.shape[1])])
    assert torch.equal(rows, alone)


def test_the_same_weights_give_the_same_numbers_wherever_they_lie():
    """A model loaded twice must not differ (MKL rounded by the weights' address; oneDNN does
    not, and the weights are aligned all the same)."""
    torch.manual_seed(3)
    layer = nn.Linear(576, 1536, bias=False)
    x = torch.randn(8, 576)
    use_row_invariant_linear(layer)
    with torch.no_grad():
        want = layer(x)
    for shift in range(1, 16):
        buffer = torch.empty(layer.weight.numel() + shift)
        moved = nn.Linear(576, 1536, bias=False)
        moved.weight = nn.Parameter(buffer[shift:].view_as(layer.weight).copy_(layer.weight))
        assert use_row_invariant_linear(moved) == 1 and moved.weight.data_ptr() % 64 == 0
        with torch.no_grad():
            assert torch.equal(moved(x), want), f"weights {4 * shift} bytes off"


def test_a_model_read_from_safetensors_is_copied_whole_to_aligned_memory(tiny, tmp_path):
    """Its linear weights must be aligned (above); so must every other tensor, or the mapped
    file stays resident beside the copies (the model's memory doubled)."""
    from positronic.models import load_model

    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    assert all(tensor.data_ptr() % 64 == 0 for tensor in tensors)
    assert all(type(m) is RowInvariantLinear for m in loaded.model.modules() if isinstance(m, nn.Linear))


@pytest.mark.skipif(not PACKS, reason="this torch cannot keep a weight in oneDNN's layout")
@pytest.mark.parametrize("bias", [False, True])
def test_the_weight_kept_in_onednns_layout_gives_every_row_the_same_bits_at_every_row_count(bias):
    """The kept copy decides the kernel for every row count: a row's bits are the same alone, in a
    decode round, in a prompt chunk beside other rows, in a 300-row prefill; and they are the
    plain weight's numbers (the plain call's own bits differ by ~1e-6 on AMX Xeons, where its
    kernel changes with the row count: the module docstring)."""
    torch.manual_seed(7)
    layer = nn.Linear(576, 1536, bias=bias)
    use_row_invariant_linear(layer)
    assert layer.packs
    x = torch.randn(300, 576)
    with torch.no_grad():
        alone = torch.cat([layer(x[k : k + 1]) for k in range(300)])
        assert "_onednn_weight" in layer.__dict__
        for rows in (2, 8, 64, 300):
            assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
        others = torch.randn(7, 576)  # a 64-row prompt chunk fed beside other sequences' decode rows
        assert torch.equal(layer(torch.cat([others[:3], x[:64], others[3:]]))[3:67], alone[:64])
        layer.packs = False
        torch.testing.assert_close(layer(x), alone, rtol=1e-5, atol=1e-5)


def test_a_plain_layer_keeps_decode_rounds_of_up_to_eight_rows_row_invariant():
    """Without the copy (too little memory), a decode round of up to 8 sequences still gives each
    the bits it gets alone, on both CPUs measured (this project's AVX2 EPYC, a lent machine's AMX
    Xeon)."""
    torch.manual_seed(9)
    layer = nn.Linear(576, 1536)
    use_row_invariant_linear(layer)
    layer.packs = False
    x = torch.randn(8, 576)
    with torch.no_grad():
        alone = torch.cat([layer(x[k : k + 1]) for k in range(8)])
        for rows in (2, 3, 8):  # the counts measured on both CPUs
            assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
    assert "_onednn_weight" not in layer.__dict__


@pytest.mark.skipif(not PACKS, reason="this torch cannot keep a weight in oneDNN's layout")
def test_a_weight_changed_after_its_copy_was_made_is_copied_again():
    torch.manual_seed(8)
    layer = nn.Linear(64, 96)
    use_row_invariant_linear(layer)
    x = torch.randn(4, 64)
    with torch.no_grad():
        layer(x)  # the copy is made
        layer.weight.mul_(-2)  # in place (a state dict loaded into the model, say)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(96, 64), requires_grad=False)  # replaced
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # made in inference mode: no version counter to tell a change by
        made = nn.Linear(64, 96)
    use_row_invariant_linear(made)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            torch.testing.assert_close(made(x), F.linear(x, made.weight, made.bias), rtol=1e-5, atol=1e-5)
            assert "_onednn_weight" not in made.__dict__
    with torch.inference_mode():
        made.weight.mul_(3)
        torch.testing.assert_close(made(x), F.linear(x, made.weight, made.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not PACKS, reason="this torch cannot keep a weight in oneDNN's layout")
def test_without_the_memory_for_a_copy_the_layers_stay_plain_and_say_so(monkeypatch, caplog):
    from positronic.models import linear

    layer = nn.Linear(64, 96)  # 24,576 bytes of weight
    monkeypatch.setattr(linear, "available_memory", lambda: 40_000)
    with caplog.at_level("WARNING", logger=linear.__name__):
        use_row_invariant_linear(layer)
    assert not layer.packs and "stay in their plain layout" in caplog.text
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert "_onednn_weight" not in layer.__dict__
    roomy = nn.Linear(64, 96)
    monkeypatch.setattr(linear, "available_memory", lambda: 60_000)
    use_row_invariant_linear(roomy)
    assert roomy.packs


def test_the_compiled_rounds_op_is_the_layers_product_and_follows_a_changed_weight():
    """`row_linear` (the op a compiled round's float32 products call on a CPU): the layer's own
    bits for 1-8 rows, each row the same bits among any others, and a weight written in place or
    a new weight is packed again (not the stale copy's numbers)."""
    from positronic.models.linear import row_linear

    torch.manual_seed(9)
    layer = nn.Linear(64, 96)
    use_row_invariant_linear(layer)
    x = torch.randn(8, 1, 64)
    with torch.no_grad():
        for rows in range(1, 9):
            got = row_linear(x[:rows], layer.weight, layer.bias)
            assert torch.equal(got, layer(x[:rows])) and torch.equal(got, row_linear(x, layer.weight, layer.bias)[:rows])
        layer.weight.mul_(-2)
        torch.testing.assert_close(row_linear(x, layer.weight, None), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        other = torch.randn(96, 64)
        torch.testing.assert_close(row_linear(x, other, None), F.linear(x, other), rtol=1e-5, atol=1e-5)
