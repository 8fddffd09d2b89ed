import pytest

from steps.cull import DEFAULT_BUDGET, cull_count


@pytest.mark.parametrize(
    "length, budget, expected",
    [(0, 500, 0), (499, 500, 0), (500, 500, 1), (501, 500, 2), (10_000, 500, 2), (3, 3, 1)],
)
def test_cull_count(length, budget, expected):
    assert cull_count(length, budget) == expected


def test_default_budget_is_500():
    assert DEFAULT_BUDGET == 500
    assert cull_count(500) == 1 and cull_count(499) == 0


@pytest.mark.parametrize("length, budget", [(-1, 500), (10, 0), (True, 5), (10, 2.5)])
def test_invalid_arguments(length, budget):
    with pytest.raises(ValueError):
        cull_count(length, budget)
