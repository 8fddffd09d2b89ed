"""Loading the causal LMs Positronic Brain runs on (DESIGN.md §7).

`load_model(name)` returns a `LoadedModel`: an eval-mode causal LM of a family splicing is
proven for (Llama, Mistral, Qwen2, Qwen3, Phi-3; checks.py) with SDPA attention registered under
names of ours (attention.py: on a CPU grouped-query attention kept under a mask; everywhere a
tap that reads each layer's query and keys, which the attention row and SmartKV use), its
tokenizer and the shape facts the cache code needs.
Names: "smollm2" (embedded GGUF, converted once to a safetensors cache), "tinyllama", a local
directory, a .gguf file or a hub id, "random:tinyllama" / "random:tiny" and one "random:<family>"
per family (random weights, built-in tokenizer). Failures are `ModelError`s whose message is one line.

    loading.py        load_model, LoadedModel, name / device / dtype resolution, the hub
    random_models.py  random weights and the byte tokenizer; each family's tiny config
    smollm2.py        the embedded GGUF
    gguf.py           any GGUF file, converted once into a safetensors cache
    checks.py         what a model must be for exact splicing; ModelError; the position limit
    attention.py      the attention functions and their tap
    lean.py           a Llama's forward without the library's per-call scaffolding, same bits
    linear.py         CPU float32 linear layers whose rows do not change each other's numbers
    weights.py        --weights: int8, int4 and bfloat16 linear layers, rows still independent
    tiles.py          the same on a GPU in half precision: row-wise layers in fixed 64-row tiles
    compat.py         with_cache: the keyword a Cache goes under in this transformers version
"""

from .compat import cache_keyword, with_cache
from .checks import FAMILIES, SUPPORTED_ROPE_TYPES, ModelError, ModelNotAvailable, check_config, check_model, position_limit
from .loading import DTYPE_NAMES, TINYLLAMA_ID, LoadedModel, load_model
from .random_models import FAMILY_SHAPES, RANDOM_SHAPES, byte_tokenizer, random_config, random_names
from .gguf import cache_root, gguf_cache
from .smollm2 import SMOLLM2_CACHE_NAME, SMOLLM2_DIST, SMOLLM2_FILE, fetch_smollm2, smollm2_cache, smollm2_gguf

__all__ = [
    "DTYPE_NAMES", "FAMILIES", "FAMILY_SHAPES", "RANDOM_SHAPES", "SMOLLM2_CACHE_NAME", "SMOLLM2_DIST", "SMOLLM2_FILE", "SUPPORTED_ROPE_TYPES", "TINYLLAMA_ID",
    "LoadedModel", "ModelError", "ModelNotAvailable", "byte_tokenizer", "cache_keyword", "cache_root", "check_config",
    "check_model", "gguf_cache", "load_model", "position_limit", "random_config", "random_names", "fetch_smollm2", "smollm2_cache", "smollm2_gguf", "with_cache",
]
