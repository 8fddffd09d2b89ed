"""compat.py: the brain and a user's generate pass their cache under the keyword the installed
transformers takes, so no deprecation warning is raised and nothing breaks when the old name goes."""

import inspect
import re
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaModel

from positronic import SpliceCache, StateManager
from positronic.models import cache_keyword, with_cache


def test_the_keyword_is_a_parameter_of_the_installed_llama_forward_and_generate_takes_it(tiny):
    assert cache_keyword() in inspect.signature(LlamaModel.forward).parameters
    ids = torch.tensor([[tiny.bos_id, 5, 9, 77, 3]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated keyword would raise here
        plain = tiny.model.generate(ids, max_new_tokens=6, do_sample=False, **with_cache(DynamicCache(config=tiny.model.config)))
        spliced = tiny.model.generate(ids, max_new_tokens=6, do_sample=False,
                                      **with_cache(SpliceCache(tiny.model.config, max_cache_len=32)))
    assert torch.equal(plain, spliced)


def test_a_brain_tick_raises_no_deprecation_warning(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        sm = StateManager.from_tokens(tiny, [tiny.bos_id, 5, 9, 77, 3], capacity=16)
        sm.apply([{"action": "add", "token_id": 11}])
    assert len(sm) == 6


def test_no_source_names_the_cache_keyword_itself():
    """A literal `past_key_values=` warns from transformers 5.24 on; a literal `cache=` is silently
    swallowed by the forward's **kwargs on 5.17-5.23 (the model then runs without the cache).
    Every call goes through with_cache."""
    root = Path(__file__).resolve().parents[3]
    literal = re.compile(r"(?:model|generate)\(.*\b(?:past_key_values|cache)=(?!None)")
    offenders = [f"{path.relative_to(root)}:{number}"
                 for folder in ("positronic", "bench", "tests", "steps", "mirror")
                 for path in sorted((root / folder).rglob("*.py"))
                 if not any(part.startswith(".") for part in path.relative_to(root).parts)  # venvs
                 for number, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert offenders == []
