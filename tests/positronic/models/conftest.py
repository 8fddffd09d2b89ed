"""What the model tests share: a refusal's one-line message, RoPE's textbook frequencies and an
eager-attention forward to compare SDPA against."""

import pytest
import torch

from positronic.models import load_model


def _one_line_error(exc_type, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        load_model(*args, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message
    return message


@pytest.fixture(scope="session")
def one_line_error():
    """one_line_error(ExcType, *load_model_args): the message, asserted to be one line."""
    return _one_line_error


@pytest.fixture(scope="session")
def expected_inv_freq():
    """expected_inv_freq(theta, head_dim): RoPE's frequencies written from the paper's formula."""
    return lambda theta, head_dim: 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)


def _eager_forward(lm, ids: list[int]):
    previous = lm.model.config._attn_implementation
    lm.model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            return lm.model(torch.tensor([ids]), output_attentions=True)
    finally:
        lm.model.config._attn_implementation = previous


@pytest.fixture(scope="session")
def eager_forward():
    """eager_forward(lm, ids): a plain forward with eager attention and its attention weights
    (the model is switched back to SDPA afterwards)."""
    return _eager_forward
