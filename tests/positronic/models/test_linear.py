"""FewRowsLinear: a CPU model's linear layers give nn.Linear's numbers for every row count."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from positronic.models.linear import FEW_ROWS, FewRowsLinear, use_few_rows_linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 8, FEW_ROWS, FEW_ROWS + 1, 300])
def test_every_row_count_gives_nn_linears_numbers(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(96, 160, bias=bias)
    want = F.linear(x := torch.randn(1, rows, 96), layer.weight, layer.bias)
    assert use_few_rows_linear(layer) == 1 and type(layer) is FewRowsLinear
    got = layer(x)
    assert got.shape == (1, rows, 160) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if rows == 1 or rows > FEW_ROWS:  # what a one-token tick relies on: the very same numbers as before
        assert torch.equal(got, want)


def test_a_cpu_model_has_them_with_its_tied_head_still_tied(tiny):
    linears = [m for m in tiny.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FewRowsLinear for m in linears)
    head, embed = tiny.model.get_output_embeddings(), tiny.model.get_input_embeddings()
    if tiny.model.config.tie_word_embeddings:
        assert head.weight is embed.weight
    assert use_few_rows_linear(tiny.model) == 0, "a second pass finds nothing left to change"


def test_a_batch_of_rows_through_the_model_matches_one_row_at_a_time(tiny):
    """What a batched tick relies on: eight tokens fed as eight rows give each one's logits as
    fed alone (same positions, no cache)."""
    ids = torch.tensor([[tiny.bos_id, 5, 9, 11, 40, 41, 7, 3]])
    with torch.inference_mode():
        rows = tiny.model(input_ids=ids.T, position_ids=torch.zeros_like(ids.T)).logits[:, 0]  # 8 sequences of 1
        alone = torch.cat([tiny.model(input_ids=ids[:, k : k + 1], position_ids=torch.zeros((1, 1), dtype=torch.long))
                           .logits[0] for k in range(ids.shape[1])])
    torch.testing.assert_close(rows, alone, rtol=1e-4, atol=1e-4)


def test_the_same_weights_give_the_same_numbers_wherever_they_lie():
    """MKL rounds W @ x.T by the weights' address: a model loaded twice must not differ."""
    torch.manual_seed(3)
    layer = nn.Linear(576, 1536, bias=False)
    x = torch.randn(8, 576)
    use_few_rows_linear(layer)
    want = layer(x)
    for shift in range(1, 16):
        buffer = torch.empty(layer.weight.numel() + shift)
        moved = nn.Linear(576, 1536, bias=False)
        moved.weight = nn.Parameter(buffer[shift:].view_as(layer.weight).copy_(layer.weight))
        assert use_few_rows_linear(moved) == 1 and moved.weight.data_ptr() % 64 == 0
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
    assert all(type(m) is FewRowsLinear for m in loaded.model.modules() if isinstance(m, nn.Linear))
