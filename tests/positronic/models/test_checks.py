"""positronic.models.checks: what exact splicing cannot handle is refused with one line naming
the feature; a sliding window is handled by keeping positions below it."""

import pytest
import torch
import transformers

from positronic import models
from positronic.models import ModelError, load_model


def test_non_decoder_family_is_refused_by_name(tmp_path, one_line_error):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    message = one_line_error(ModelError, str(tmp_path))
    assert "'gpt2'" in message and "qwen3" in message  # names what is supported


def _llama(**settings):
    config = transformers.LlamaConfig()
    for key, value in settings.items():
        setattr(config, key, value)
    return config


REFUSED = [
    (_llama(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "RoPE type 'yarn'.*attention factor"),
    (_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "'dynamic'.*sequence length"),
    (_llama(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "'longrope'"),
    (_llama(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}), "RoPE type 'mrope'"),
    (_llama(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}), "partial rotary"),
    (_llama(layer_types=["full_attention", "linear_attention"]), r"layer types \['linear_attention'\]"),
    (_llama(layer_types=["full_attention", "chunked_attention"]), "chunked_attention"),
    (_llama(attn_logit_softcapping=50.0), "soft-capping"),
    (_llama(no_rope_layers=[1, 1, 0, 1]), "layers without RoPE"),
    (_llama(sliding_window=3), "sliding window 3"),
    (transformers.Gemma2Config(), "soft-capping|gemma2"),
    (transformers.GPT2Config(), "'gpt2'"),
    (transformers.T5Config(), "encoder-decoder"),
]


@pytest.mark.parametrize("config, message", REFUSED, ids=lambda v: getattr(v, "model_type", None) or str(v)[:20])
def test_each_unsplicable_feature_is_refused_naming_it(config, message):
    with pytest.raises(ModelError, match=message) as error:
        models.check_config(config)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("config", [
    transformers.LlamaConfig(),
    transformers.LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}),
    transformers.Qwen2Config(), transformers.Qwen3Config(), transformers.MistralConfig(sliding_window=None),
    transformers.MistralConfig(sliding_window=4096), transformers.Phi3Config(sliding_window=2047),
], ids=["llama", "llama3", "qwen2", "qwen3", "mistral", "mistral-sliding", "phi3-sliding"])
def test_supported_families_pass(config):
    models.check_config(config)


def test_a_sliding_window_bounds_the_positions_the_cache_uses():
    assert models.position_limit(transformers.Phi3Config(sliding_window=2047, max_position_embeddings=4096)) == 2047
    assert models.position_limit(transformers.MistralConfig(sliding_window=None, max_position_embeddings=32768)) == 32768
    assert load_model("random:phi3", device="cpu").max_positions == 255


def test_within_the_position_limit_the_models_own_sliding_mask_hides_nothing():
    """random:phi3 (window 255): the model's own forward (its sliding-window mask) over 255
    tokens gives what full attention gives, and over 300 it does not (the window bites)."""
    lm = load_model("random:phi3", device="cpu", dtype="float32")
    ids = [(31 * i) % 500 + 3 for i in range(300)]

    def last_logits(n, window):
        lm.model.config.sliding_window = window
        try:
            with torch.no_grad():
                return lm.model(torch.tensor([ids[:n]])).logits[0, -1]
        finally:
            lm.model.config.sliding_window = 255
    torch.testing.assert_close(last_logits(255, 255), last_logits(255, None))
    assert not torch.allclose(last_logits(300, 255), last_logits(300, None))
