"""positronic.models.checks: what exact splicing cannot handle is refused."""


import pytest
import transformers

from positronic import models
from positronic.models import ModelError


def test_non_llama_model_is_refused(tmp_path, one_line_error):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    assert "'gpt2'" in one_line_error(ModelError, str(tmp_path))


def test_unsupported_rope_and_sliding_window_are_refused():
    yarn = transformers.LlamaConfig(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                     "rope_theta": 10000.0})
    with pytest.raises(ModelError, match="RoPE type 'yarn'"):
        models.check_config(yarn)
    sliding = transformers.LlamaConfig()
    sliding.sliding_window = 4096
    with pytest.raises(ModelError, match="sliding-window"):
        models.check_config(sliding)
    models.check_config(transformers.LlamaConfig())
