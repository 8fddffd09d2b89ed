"""A `.gguf` file as a model: read once through transformers' GGUF loader (which de-quantizes
every tensor, ~30 s for a 135M model, minutes for billions of parameters) and written as a
safetensors directory in the user cache, which every later load reads directly."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import transformers
from transformers import AutoTokenizer

from ..util import atomic_write_dir, error_line, quiet_transformers
from .checks import ModelError, check_config


def cache_root() -> Path:
    """$POSITRONIC_CACHE, or ~/.cache/positronic."""
    return Path(os.environ.get("POSITRONIC_CACHE") or Path.home() / ".cache" / "positronic")


def gguf_cache(gguf: Path, name: str | None = None, *, stamp: dict | None = None, label: str | None = None) -> Path:
    """Directory of the converted `gguf` (config, model.safetensors, tokenizer) under cache_root();
    converts it on first use, and again when the file changes (its path, size and mtime, or
    `stamp`, differ from the conversion's). name: the directory's name (default: from the file's
    name and path). The config is checked before the slow de-quantization starts."""
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise ModelError(f"GGUF file {str(gguf)!r} does not exist or is not a regular file")
    info = gguf.stat()
    source = stamp or {"gguf": str(gguf), "bytes": info.st_size, "mtime_ns": info.st_mtime_ns}
    if name is None:
        digest = hashlib.sha256(str(gguf).encode()).hexdigest()[:12]
        name = f"gguf-{gguf.stem}-{digest}"
    target = cache_root() / name
    marker = target / "source.json"
    if marker.is_file() and json.loads(marker.read_text()) == source:
        return target
    try:
        config = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        head_dim = _stated_head_dim(gguf)
    except Exception as e:  # not a GGUF transformers can read: one line, not a traceback
        raise ModelError(f"cannot read GGUF file {str(gguf)!r}: {error_line(e)}") from None
    if head_dim is not None:  # transformers reads no head width for qwen2/qwen3: the class default (128) stood
        config.head_dim = head_dim
    check_config(config)
    print(f"converting {label or gguf.name} GGUF to safetensors (one time)…", file=sys.stderr, flush=True)
    with quiet_transformers(progress=True):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers < 5.18 gives a llama-family GGUF's tokenizer the bos token as its eos
    # (GGUFLlamaConverter: tokens[bos_token_id]); the config read from the file has the right id
    if isinstance(config.eos_token_id, int) and tokenizer.eos_token_id != config.eos_token_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)

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


def _stated_head_dim(gguf: Path) -> int | None:
    """The head width the file states (`<arch>.attention.key_length`, which llama.cpp writes when
    the model's config names a head_dim, as Qwen3's does), or None where it states none."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    stated = fields.get(f"{fields['general.architecture'].contents()}.attention.key_length")
    return None if stated is None else int(stated.contents())
