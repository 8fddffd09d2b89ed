"""Labels (positronic/smartkv/labels.py): a token's lifespan from the model's attention, and the
windows that label every token once."""

import pytest
import torch

from positronic.models import attention
from positronic.smartkv.labels import LifespanRule, lifespans, log4, windows


def test_lifespan_counts_later_queries_above_the_threshold():
    length = 6
    attention = torch.zeros(2, length, length)
    for i in range(length):
        attention[:, i, : i + 1] = 1.0 / (i + 1)  # uniform: nobody is above the uniform share
    attention[1, 3, 1] = 0.9   # head 1 uses key 1 at query 3
    attention[0, 5, 1] = 0.5   # head 0 at query 5 (0.5 > 2 / 6)
    attention[0, 4, 2] = 0.3   # 0.3 < 2 / 5: not used
    rule = LifespanRule(horizon=3, threshold=2.0, window=6)
    spans = lifespans(attention, rule, first=1, count=2)
    assert spans.tolist() == [[1, 0]]  # query 5 is beyond key 1's horizon (1 + 3)
    wide = lifespans(attention, LifespanRule(horizon=4, threshold=2.0, window=6), first=1, count=1)
    assert wide.tolist() == [[2]]
    # per kv head (2 groups of one query head each): each head counts only its own uses
    assert lifespans(attention, LifespanRule(horizon=4, threshold=2.0, window=6), 1, 1, groups=2).tolist() == [[1], [1]]
    with pytest.raises(ValueError, match="do not split into 3"):
        lifespans(attention, rule, first=1, count=1, groups=3)
    assert log4(torch.tensor([0.0, 3.0, 15.0]) + 1).tolist() == pytest.approx([0.0, 1.0, 2.0])


def test_windows_label_every_token_once_with_a_whole_horizon():
    rule = LifespanRule(horizon=4, threshold=1.0, window=10)
    ids = list(range(40))
    spans = windows(ids, rule)
    labelled = [start + k for start, _ in spans for k in range(rule.labelled_per_window)]
    assert labelled == list(range(len(labelled)))  # contiguous, no token twice
    for start, chunk in spans:
        assert len(chunk) == rule.window - 1 and chunk[0] == ids[start]
    with pytest.raises(ValueError):
        LifespanRule(horizon=9, window=10)


@pytest.mark.parametrize("per_head", [False, True])
def test_labels_are_eager_attentions_lifespans_and_keys_are_what_k_proj_wrote(tiny, per_head):
    """The tap-built labels against the model's own eager attention weights and k_proj's
    output, read with hooks the plain transformers way."""
    from positronic.smartkv.labels import label_text

    rule = LifespanRule(horizon=8, threshold=1.5, window=24)
    text = "the lamp was trimmed twice a night; the keeper wrote in his log " * 2
    labelset = label_text(tiny, text, rule, per_head=per_head)
    model, ids = tiny.model, tiny.encode(text)
    start, chunk = windows(ids, rule)[0]
    captured = {}
    handles = [layer.self_attn.k_proj.register_forward_hook(
        lambda m, i, o, l=l: captured.__setitem__(l, o[0])) for l, layer in enumerate(model.model.layers)]
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([[tiny.bos_id] + chunk]), output_attentions=True)
    finally:
        model.set_attn_implementation(attention.for_device(tiny.device))
        for handle in handles:
            handle.remove()
    count = rule.labelled_per_window
    groups = tiny.num_kv_heads if per_head else 1
    for l in range(tiny.num_layers):
        torch.testing.assert_close(labelset.keys[l][:count], captured[l][1:1 + count], atol=1e-5, rtol=1e-5)
        expected = log4(lifespans(out.attentions[l][0], rule, 1, count, groups).T + 1)
        torch.testing.assert_close(labelset.labels[l][:count], expected)
