"""Loading the causal LMs Positronic Brain runs on (DESIGN.md §7).

`load_model(name)` returns a `LoadedModel`: an eval-mode Llama-family model with SDPA
attention (on a CPU through attention.py, which keeps grouped-query attention under a mask;
the attention row the brain reads comes from a hook, see forward.py), its tokenizer and the
shape facts the cache code needs.
Names: "smollm2" (embedded GGUF, converted once to a safetensors cache), "tinyllama", a local
directory or hub id, "random:tinyllama" / "random:tiny" (random weights, built-in tokenizer).
Failures are `ModelError`s whose message is one line.

    loading.py        load_model, LoadedModel, name / device / dtype resolution, the hub
    random_models.py  random weights and the byte tokenizer
    smollm2.py        the embedded GGUF and its safetensors cache
    checks.py         what a model must be for exact splicing; ModelError
    attention.py      the CPU attention function (SDPA, grouped-query under a mask too)
    compat.py         with_cache: the keyword a Cache goes under in this transformers version
"""

from .compat import cache_keyword, with_cache
from .checks import SUPPORTED_ROPE_TYPES, ModelError, ModelNotAvailable, check_config, check_model
from .loading import DTYPE_NAMES, TINYLLAMA_ID, LoadedModel, load_model
from .random_models import RANDOM_SHAPES, byte_tokenizer
from .smollm2 import SMOLLM2_CACHE_NAME, SMOLLM2_DIST, cache_root, smollm2_cache, smollm2_gguf

__all__ = [
    "DTYPE_NAMES", "RANDOM_SHAPES", "SMOLLM2_CACHE_NAME", "SMOLLM2_DIST", "SUPPORTED_ROPE_TYPES", "TINYLLAMA_ID",
    "LoadedModel", "ModelError", "ModelNotAvailable", "byte_tokenizer", "cache_keyword", "cache_root", "check_config",
    "check_model", "load_model", "smollm2_cache", "smollm2_gguf", "with_cache",
]
