import pytest
import torch

from positronic.steps.attention import layer_indices, scores

# [layers=3, heads=2, live=4]
ATT = torch.tensor(
    [
        [[0.1, 0.2, 0.3, 0.4], [0.3, 0.2, 0.1, 0.4]],
        [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]],
        [[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]],
    ]
)


def test_last_layer_mean_over_heads_is_default():
    assert scores(ATT) == pytest.approx([0.25, 0.25, 0.25, 0.25])
    assert scores(ATT, "last") == scores(ATT)
    assert scores(ATT, [1]) == pytest.approx([0.5, 0.0, 0.0, 0.5])


# "all": per layer the mean over heads is [0.2, 0.2, 0.2, 0.4], [0.5, 0, 0, 0.5] and [0.25] * 4
ALL_LAYERS = [0.95 / 3, 0.45 / 3, 0.45 / 3, 1.15 / 3]


def test_all_layers_mean():
    assert scores(ATT, "all") == pytest.approx(ALL_LAYERS)


def test_selected_layers_with_negative_index():
    # layers 0 and 2: (mean over heads) -> [0.2,0.2,0.2,0.4] and [0.25]*4, averaged
    assert scores(ATT, [0, -1]) == pytest.approx([0.225, 0.225, 0.225, 0.325])
    assert scores(ATT, (-3,)) == pytest.approx([0.2, 0.2, 0.2, 0.4])


def test_returns_python_floats_even_for_float16():
    out = scores(ATT.half(), "all")
    assert isinstance(out, list) and all(type(x) is float for x in out)
    assert out == pytest.approx(ALL_LAYERS, abs=1e-3)


@pytest.mark.parametrize("spec", ["first", [], [3], [-4], [True], [0, 0], [0, -3], 2, [1.0]])
def test_invalid_layer_spec_raises(spec):
    with pytest.raises(ValueError, match="layer"):
        scores(ATT, spec)


@pytest.mark.parametrize("bad", [torch.zeros(2, 4), torch.zeros(0, 2, 4), torch.zeros(2, 0, 4)])
def test_invalid_attention_shape_raises(bad):
    with pytest.raises(ValueError, match="attention"):
        scores(bad)


def test_layer_indices_resolves_negatives():
    assert layer_indices([-1, 0], 5) == [4, 0]
    assert layer_indices("all", 3) == [0, 1, 2]
