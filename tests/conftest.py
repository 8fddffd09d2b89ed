"""Shared fixtures: the real embedded model (SmolLM2, float32 on CPU) and tiny random Llamas."""

import pytest
import torch

from positronic.models import load_model


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M from the embedded GGUF (converted once into the user cache)."""
    return load_model("smollm2", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random Llama (float32): fast enough for property tests."""
    return load_model("random:tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_half():
    """The same tiny shape in float16, for drift tests."""
    return load_model("random:tiny", device="cpu", dtype="float16")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
