"""The one place where the transformers versions the project supports (>= 5.17, < 6) differ
for it: the keyword a Cache is passed under.

transformers 5.24 renamed the `past_key_values` argument of the Llama forward and of
`generate` to `cache`, keeping the old name as a deprecated alias (a FutureWarning on every
call site, the alias gone from the forward in 5.40); 5.17 to 5.23 know only `past_key_values`.
`with_cache(cache)` gives the name the installed version takes:

    model(input_ids=ids, **with_cache(cache), use_cache=True)
    model.generate(ids, **with_cache(cache), max_new_tokens=32)
"""

from __future__ import annotations

import functools
import inspect


@functools.cache
def cache_keyword() -> str:
    """"cache" where the installed Llama forward has that parameter, else "past_key_values"."""
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def with_cache(cache) -> dict:
    """{keyword: cache}, to splat into a model forward or `generate`."""
    return {cache_keyword(): cache}
