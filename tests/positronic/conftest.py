"""Fixtures shared by the test modules of positronic/ (the folder's own modules)."""

import pytest
import torch

from positronic.state_manager import ContextView


def _crafted_view(token_ids, predicted, brightness=None) -> ContextView:
    n = len(token_ids)
    return ContextView(token_ids=torch.tensor(token_ids), ledger_ids=torch.arange(n), positions=torch.arange(n),
                       brightness=torch.tensor(brightness if brightness is not None else [255.0] * n),
                       predicted=torch.tensor(predicted))


@pytest.fixture(scope="session")
def crafted_view():
    """crafted_view(token_ids, predicted, brightness=None) -> a ContextView built by hand (what a
    policy or repairer sees; no StateManager behind it), ledger ids and positions 0..n-1."""
    return _crafted_view
