"""positronic.models.checks: what exact splicing cannot handle is refused with one line naming
the feature; a sliding window is handled by keeping positions below it."""

import re
import types

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


OUT_OF_RANGE = [  # (settings on a LlamaConfig, what the one line says)
    (dict(num_hidden_layers=0), r"num_hidden_layers = 0 is out of range: an integer from 1 to 1024"),
    (dict(num_hidden_layers=10**6), r"num_hidden_layers = 1000000 is out of range"),
    (dict(vocab_size=0), r"vocab_size = 0 is out of range"),
    (dict(hidden_size=2**40), r"hidden_size = 1099511627776 is out of range"),
    (dict(intermediate_size=-1), r"intermediate_size = -1 is out of range"),
    (dict(num_attention_heads=0), r"num_attention_heads = 0 is out of range"),
    (dict(num_key_value_heads=0), r"num_key_value_heads = 0 is out of range"),
    (dict(num_key_value_heads=3), r"num_attention_heads = 32 is not a multiple of num_key_value_heads = 3"),
    (dict(head_dim=0), r"head_dim = 0 is out of range: an integer from 2"),
    (dict(head_dim=33), r"head_dim = 33 is odd: RoPE rotates a head's channels in pairs"),
    (dict(head_dim=None, hidden_size=4100), r"hidden_size = 4100 is not divisible by num_attention_heads = 32"),
    (dict(max_position_embeddings=0), r"max_position_embeddings = 0 is out of range"),
    (dict(bos_token_id=2**31 - 1),
     r"bos_token_id = 2147483647 is not a token id: the vocabulary has 32000 \(0 to 31999\)"),
    (dict(eos_token_id=[2, 32000]), r"eos_token_id = 32000 is not a token id"),
    (dict(pad_token_id=-1), r"pad_token_id = -1 is not a token id"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}), r"rope_theta = 0.0 is out of range"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("inf")}), r"rope_theta = inf is out of range"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": -2.0}), r"RoPE factor = -2.0 is out of range"),
    (dict(rms_norm_eps=float("nan")), r"rms_norm_eps = nan is out of range"),
    (dict(rms_norm_eps=-1e-5), r"rms_norm_eps = -1e-05 is out of range"),
]


@pytest.mark.parametrize("settings, message", OUT_OF_RANGE, ids=lambda v: str(v)[:40])
def test_each_value_out_of_range_is_refused_naming_its_field(settings, message):
    """A value that lies surfaced deep inside transformers as an IndexError (a BOS id past the
    vocabulary), a ZeroDivisionError (0 heads) or an allocation of terabytes."""
    with pytest.raises(ModelError, match=message) as error:
        models.check_config(_llama(**settings))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("value", [2.0, True, "2", None])
def test_a_size_that_is_not_an_integer_is_refused(value):
    """transformers' configs refuse these themselves; a config read otherwise (any object) is held to the same."""
    config = types.SimpleNamespace(**{**transformers.LlamaConfig().to_dict(), "num_hidden_layers": value})
    with pytest.raises(ModelError, match=rf"num_hidden_layers = {re.escape(repr(value))} is out of range: an integer"):
        models.checks.check_ranges(config)


def test_a_refusal_names_where_the_value_came_from():
    """A GGUF's keys: the config field and the file's key it was read from."""
    with pytest.raises(ModelError, match=r"^num_attention_heads \(llama.attention.head_count\) = 0 is out of range"):
        models.check_config(_llama(num_attention_heads=0), {"num_attention_heads": "llama.attention.head_count"})


def test_transformers_loading_report_is_read_not_muted():
    """What from_pretrained(output_loading_info=True) reports: a weight it made up or dropped is a refusal."""
    from positronic.models.checks import check_loading_info
    check_loading_info({"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}, "m")
    refusals = [
        ({"missing_keys": {"model.norm.weight"}}, r"^m lacks tensor model.norm.weight, which the model needs"),
        ({"mismatched_keys": {("lm_head.weight", (5, 4), (6, 4))}},
         r"tensor lm_head.weight has shape \[5, 4\], the config makes it \[6, 4\]"),
        ({"unexpected_keys": {"x.weight", "y\nz"}}, r"holds tensors x.weight, 'y\\nz', which the model does not use"),
    ]
    for info, message in refusals:
        with pytest.raises(ModelError, match=message) as error:
            check_loading_info(info, "m")
        assert "\n" not in str(error.value)
