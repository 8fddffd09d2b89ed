"""kvpress-style use (positronic.press): a user's own model.generate() with a policy as its
cache, a padded batch whose every row gets the tokens it gets alone."""

import pytest
import torch
import transformers
from torch import nn

from positronic import press

PROMPTS = [[1] + list(range(40, 70)), [1] + list(range(200, 211)), [1] + list(range(90, 115)), [1, 5, 6, 7] * 5]


@pytest.fixture
def model(tiny):
    """A user's own model: a fresh LlamaForCausalLM of random:tiny's shape, as from_pretrained gives it."""
    config = transformers.LlamaConfig(**{k: v for k, v in tiny.model.config.to_dict().items()
                                         if k not in ("_attn_implementation", "attn_implementation")})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def padded(prompts, side="left"):
    width = max(map(len, prompts))
    rows = [[0] * (width - len(p)) + p if side == "left" else p + [0] * (width - len(p)) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) if side == "left" else [1] * len(p) + [0] * (width - len(p))
            for p in prompts]
    return torch.tensor(rows), torch.tensor(mask), width


def test_with_nothing_evicted_a_padded_batch_makes_plain_generate_s_tokens_and_the_model_comes_back(model, tiny):
    plain = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
             for p in PROMPTS]
    ids, mask, width = padded(PROMPTS)
    attention, training = model.config._attn_implementation, model.training
    with press(model, tiny.tokenizer, policy="h2o", budget=256):
        assert model.config._attn_implementation != attention  # the brain's, for its attention row
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16)
    assert out.shape == (4, width + 16) and torch.equal(out[:, :width], ids)
    assert [out[i, width:].tolist() for i in range(4)] == plain
    assert model.config._attn_implementation == attention and "generate" not in vars(model)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert model.training is training and all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("policy, side", [("default", "left"), ("streaming", "right"), ("h2o", "left"),
                                          ("scored", "right")])
def test_past_the_budget_each_row_of_a_batch_makes_its_tokens_alone(model, tiny, policy, side):
    ids, mask, width = padded(PROMPTS, side)
    with press(model, tiny.tokenizer, policy=policy, budget=48):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=40)
        alone = [model.generate(torch.tensor([p]), max_new_tokens=40)[0, len(p):].tolist() for p in PROMPTS]
    assert [out[i, width:].tolist() for i in range(4)] == alone


@pytest.mark.parametrize("policy, options", [("h2o", ""), ("streaming", ""), ("knorm", "mix=0.2")])
def test_prompts_several_times_the_budget_each_row_makes_its_tokens_alone(model, tiny, policy, options):
    """Prompts 2-5x the budget (a pruned prompt once kept a window of a quarter of its own
    length, the budget's worth, and one row past the budget, so no engine seat fitted it)."""
    prompts = [[1] + [(11 * i + 7 * row) % 400 + 5 for i in range(120 + 40 * row)] for row in range(4)]
    ids, mask, width = padded(prompts)
    with press(model, tiny.tokenizer, policy=policy, budget=48, policy_options=options):  # knorm: a press's policy
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12)
        alone = [model.generate(torch.tensor([p]), max_new_tokens=12)[0, len(p):].tolist() for p in prompts]
    assert [out[i, width:width + len(a)].tolist() for i, a in enumerate(alone)] == alone  # a row may end early


def test_sampling_draws_each_row_with_its_own_seed(model, tiny):
    ids, mask, width = padded(PROMPTS)
    fields = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_k=0, top_p=0.95)
    with press(model, tiny.tokenizer, policy="streaming", budget=40, seed=7):
        out = model.generate(ids, attention_mask=mask, **fields)
    for row, prompt in enumerate(PROMPTS):
        with press(model, tiny.tokenizer, policy="streaming", budget=40, seed=7 + row):
            alone = model.generate(torch.tensor([prompt]), **fields)[0, len(prompt):].tolist()
        assert out[row, width:].tolist() == alone


def test_a_row_ends_at_its_end_of_sequence_token_and_the_rest_is_padding(model, tiny):
    ids, mask, width = padded(PROMPTS[:2])
    with press(model, tiny.tokenizer, policy="h2o", budget=40):
        first = model.generate(ids, attention_mask=mask, max_new_tokens=6)
        stop = int(first[0, width + 2])  # row 0's third token ends it now
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=stop, pad_token_id=3)
    row = out[0, width:].tolist()
    assert row[:row.index(stop) + 1] == first[0, width:width + row.index(stop) + 1].tolist()
    assert all(t == 3 for t in row[row.index(stop) + 1:])


def test_what_cannot_be_done_is_refused_by_name_and_the_model_is_untouched(model, tiny):
    ids = torch.tensor([PROMPTS[0]])
    for kwargs, error, message in [(dict(num_beams=2), ValueError, "num_beams=2 is not supported"),
                                   (dict(streamer=object()), TypeError, "does not take streamer"),
                                   (dict(return_dict_in_generate=True), ValueError, "only token ids")]:
        with press(model, tiny.tokenizer, policy="h2o", budget=64):
            with pytest.raises(error, match=message):
                model.generate(ids, max_new_tokens=4, **kwargs)
    attention = model.config._attn_implementation
    for kwargs, message in [(dict(budget=64, compression_ratio=0.5), "give one of budget"),
                            (dict(compression_ratio=1.0), "compression_ratio must be in"),
                            (dict(budget=8), "leaves no room to cull"),
                            (dict(budget=64, colour="red"), "colour is not a setting")]:
        with pytest.raises(ValueError, match=message):
            with press(model, tiny.tokenizer, policy="h2o", **kwargs):
                pass
        assert model.config._attn_implementation == attention and "generate" not in vars(model)


def test_compression_ratio_sets_each_row_s_budget_from_its_prompt(model, tiny, monkeypatch):
    from positronic.batch import generate as module

    budgets = []
    start = module.Brain.start
    monkeypatch.setattr(module.Brain, "start", lambda lm, prompt, config, **kw: budgets.append(config.budget)
                        or start(lm, prompt, config, **kw))
    prompts = [[1] + list(range(10, 110)), [1] + list(range(200, 279))]
    ids, mask, width = padded(prompts)
    with press(model, tiny.tokenizer, policy="streaming", compression_ratio=0.5):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5)
        assert budgets == [51, 40] and out.shape == (2, width + 5)
        with pytest.raises(ValueError, match=r"compression_ratio 0.5 gives row 0 \(6 prompt tokens\) a budget of 3"):
            model.generate(torch.tensor([[1, 2, 3, 4, 5, 6]]), max_new_tokens=2)
