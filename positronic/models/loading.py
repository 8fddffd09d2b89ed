"""`load_model(name)`: resolve a name to weights, device and dtype, load, check, and wrap the
model as a `LoadedModel` with the shape facts the cache code needs."""

from __future__ import annotations

import functools
import json
import math
import re
import socket
import sys
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..util import DTYPES, error_line, quiet_transformers
from . import attention
from .checks import (ModelError, ModelNotAvailable, check_config, check_loading_info, check_model, model_tensors,
                     position_limit, printable, stored_shapes, tensor_list)
from .random_models import random_model, random_names
from .gguf import gguf_cache
from .linear import use_row_invariant_linear
from .tiles import use_row_tiles
from .weights import CALIBRATION, WEIGHTS, layer_bytes, quantized_gguf, use_weights, weights_note
from .smollm2 import smollm2_cache

TINYLLAMA_ID = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
DTYPE_NAMES = {**DTYPES, "fp16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
               "fp32": torch.float32, "float": torch.float32}  # what --dtype accepts


@dataclass(frozen=True)
class LoadedModel:
    name: str
    model: transformers.PreTrainedModel
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    bos_id: int
    eos_id: int | None
    inv_freq: torch.Tensor
    weights: str = "float32"  # the linear layers' format (weights.py): float32 | bfloat16 | int8 | int8-weight-only | int4

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added (the caller adds BOS itself)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), without encoding it: no token covers more
        characters than its longest vocabulary entry (a byte-level entry spells one byte per
        character, a SentencePiece one at least its text). A 10 MB prompt is known too long at
        once, where encoding it first took tens of seconds."""
        return -(-len(text) // _longest_entry(self.tokenizer))

    def decode(self, ids: list[int]) -> str:
        """The text of a whole span of ids, decoded at once, special tokens included."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)


@functools.lru_cache(maxsize=8)
def _longest_entry(tokenizer) -> int:
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))


def load_model(name: str = "smollm2", device: str | None = None,
               dtype: str | torch.dtype | None = None, *, weights: str | None = None,
               allow_download: bool = True, compiled: bool = False) -> LoadedModel:
    """Load model `name` onto `device` (default: cuda if available, else cpu) in `dtype`
    (default: float16 on cuda, float32 on cpu; "auto": the checkpoint's own dtype), its linear
    layers in the format `weights` names (weights.py; None: "auto", which is int8 for a GGUF
    file of quantized weights and the loaded dtype otherwise), and return it as a
    `LoadedModel`. `allow_download=False`: a hub id is read from the local cache only, never
    fetched (a name that came from an untrusted file). `compiled`: the model will run compiled
    rounds (`--compile`), for which "auto" on a quantized GGUF is int8-weight-only, the format a
    round computes fastest (docs/weights.md)."""
    dev = _resolve_device(device)
    auto = isinstance(dtype, str) and dtype.lower() == "auto"
    dt = None if auto else _resolve_dtype(dtype, dev)
    weights = _resolve_weights(name, weights, dev, dt, compiled)
    with quiet_transformers():
        if name.startswith("random:"):
            model, tokenizer = random_model(name.removeprefix("random:"), dev, dt or _resolve_dtype(None, dev))
        else:
            source, local_only = _resolve_source(name)
            model, tokenizer = _pretrained(name, source, local_only or not allow_download, dev, dt)
    return _wrap(name, model, tokenizer, dev, model.dtype, weights)


def _resolve_weights(name: str, weights: str | None, dev: torch.device, dt: torch.dtype | None,
                     compiled: bool = False) -> str:
    """The linear layers' format for `weights` (None: "auto"), refused where it cannot run."""
    asked = (weights or "auto").lower()
    if asked not in WEIGHTS:
        raise ModelError(f"bad weights {weights!r}: expected {', '.join(WEIGHTS)}")
    if asked == "auto":
        if dev.type == "cpu" and dt in (None, torch.float32) and quantized_gguf(name):
            return "int8-weight-only" if compiled else "int8"
        return "float32"
    if asked != "float32" and (dev.type != "cpu" or dt not in (None, torch.float32)):
        raise ModelError(f"--weights {asked} runs on the CPU with float32 activations only "
                         f"(here: {dev.type}, {dt or 'the checkpoint dtype'}); on a GPU use --dtype")
    return asked


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelError(f"bad device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} requested but CUDA is not available here; use 'cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ModelError(f"unsupported device {device!r}: expected 'cpu' or 'cuda'")
    return dev


def _resolve_dtype(dtype: str | torch.dtype | None, dev: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float16 if dev.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    raise ModelError(f"bad dtype {dtype!r}: expected auto, float16, bfloat16 or float32")




def _resolve_source(name: str) -> tuple[str, bool]:
    """(path or hub id, whether it is local only) for a non-random model name."""
    if name == "smollm2":
        return str(smollm2_cache()), True
    if name == "tinyllama":
        return TINYLLAMA_ID, False
    path = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        return str(gguf_cache(path)), True
    if path.is_dir():
        return str(path), True
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/", "~")):
        return name, False
    raise ModelError(f"unknown model {name!r}: expected smollm2, tinyllama, {', '.join(random_names())}, "
                     "a local directory, a .gguf file or a hub id like org/name")


def _pretrained(name: str, source: str, local_only: bool, dev: torch.device, dt: torch.dtype | None):
    """The model and tokenizer at `source`, in `dt` (None: the checkpoint's own dtype, "auto")."""
    error, reached = None, False
    for local_files_only in [True] if local_only else [True, False]:
        if not local_files_only:
            reached = _hub_reachable()
            if not reached:
                break
        try:
            config = transformers.AutoConfig.from_pretrained(source, local_files_only=local_files_only)
            check_config(config)
            if Path(source).is_dir():
                _check_checkpoint_holds(name, Path(source), config)
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
            # a mis-shaped tensor is reported (and refused) rather than raised as a multi-line report
            model, info = AutoModelForCausalLM.from_pretrained(source, local_files_only=local_files_only,
                                                               dtype=dt or _checkpoint_dtype(config, dev),
                                                               attn_implementation="sdpa", output_loading_info=True,
                                                               ignore_mismatched_sizes=True)
            check_loading_info(info, f"model {name!r} ({source})")
            return model.to(dev), tokenizer
        except ModelError:
            raise
        except Exception as e:
            error = e
    if local_only:
        raise ModelError(f"cannot load model {name!r} from {source}: {error_line(error)}")
    hub = f"failed ({error_line(error)})" if reached else "cannot be reached"
    raise ModelNotAvailable(
        f"model {name!r} ({source}) is not in the local Hugging Face cache and the hub {hub}: "
        f"on a networked machine run `hf download {source}` (or pass a local "
        "directory); the embedded model `smollm2` works offline")


def _check_checkpoint_holds(name: str, source: Path, config) -> None:
    """Before anything is allocated: refuse a config whose model has a tensor of another shape
    than the directory's safetensors, or needs more values than they hold at all, naming the
    tensors. transformers would allocate the model first, initialise at random what no file
    holds and say so in a log line; a config that lies about its sizes would have it allocate
    terabytes. What the names alone cannot settle (a checkpoint under other names) is left to
    its loading report (check_loading_info)."""
    if getattr(config, "quantization_config", None):
        return  # packed weights hold fewer values than the parameters they stand for
    index = source / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
            ["model.safetensors"]
        if not all((source / file).is_file() for file in files):
            return  # no safetensors (or a broken index): transformers' loading says what is wrong
        have = stored_shapes([source / file for file in files])
    except Exception as e:
        raise ModelError(f"cannot read the safetensors of model {name!r} ({source}): {error_line(e)}") from None
    need = model_tensors(config)
    wrong = [key for key in need if key in have and tuple(have[key]) != need[key]]
    if wrong:
        raise ModelError(f"model {name!r} ({source}): tensor {printable(wrong[0])} has shape {list(have[wrong[0]])}, "
                         f"its config makes it {list(need[wrong[0]])}")
    needed, held = sum(math.prod(s) for s in need.values()), sum(math.prod(s) for s in have.values())
    missing = [key for key in need if key not in have]
    if needed > held and missing:
        raise ModelError(f"model {name!r} ({source}) lacks {tensor_list(missing)}, which the model needs: its weights "
                         "would be made up")
    if needed > held:
        raise ModelError(f"model {name!r} ({source}): its config describes {needed:,} parameters, its safetensors "
                         f"hold {held:,} values: the rest would be made up")


def _checkpoint_dtype(config, dev: torch.device) -> torch.dtype:
    """--dtype auto: the dtype the checkpoint's config names (a bf16 checkpoint stays bf16), or
    the device's default where it names none."""
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, str):
        named = DTYPE_NAMES.get(named.lower().removeprefix("torch."))
    return named if named in (torch.float16, torch.bfloat16, torch.float32) else _resolve_dtype(None, dev)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub answers a TCP connect within `timeout` (its client retries for ~25 s)."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return False
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    result = []

    def probe():
        try:
            socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
            result.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result)


def wrap_model(model, tokenizer, name: str | None = None) -> LoadedModel:
    """A LoadedModel around a model and tokenizer the caller already holds (its own
    `from_pretrained`), on the model's device and dtype. The model is changed in place as
    `load_model` changes its own (eval mode, no gradients, the project's attention
    implementation, row-invariant CPU linears): `positronic.press` puts it back afterwards."""
    return _wrap(name or getattr(model.config, "_name_or_path", "") or type(model).__name__, model, tokenizer,
                 model.device, model.dtype)


def _wrap(name: str, model, tokenizer, dev: torch.device, dt: torch.dtype, weights: str = "float32") -> LoadedModel:
    model.eval().requires_grad_(False)
    model.set_attn_implementation(attention.for_device(dev))
    if weights != "float32" and dt != torch.float32:
        raise ModelError(f"--weights {weights} needs float32 activations; model {name!r} loaded as {dt}")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else model.config.bos_token_id
    if weights != "float32":
        before = _linear_bytes(model)
        words = list(tokenizer.encode(CALIBRATION, add_special_tokens=False))
        calibration = torch.tensor([([bos] if bos is not None else []) + words])
        layers = use_weights(model, weights, calibration)
        print(f"weights: {weights} for {layers} linear layers of {name} ({before / 1e6:.0f} MB -> "
              f"{_linear_bytes(model) / 1e6:.0f} MB){weights_note(weights, model)}", file=sys.stderr, flush=True)
    if dev.type == "cpu":
        use_row_invariant_linear(model)  # a row's numbers do not depend on the rows beside it
    elif dev.type == "cuda" and dt in (torch.float16, torch.bfloat16):
        use_row_tiles(model)  # the same on a GPU, where float32 keeps them already
    check_model(name, model, tokenizer)  # the config first, before its probe runs the model
    config, rotary = model.config, model.model.rotary_emb
    if bos is None:
        raise ModelError(f"model {name!r} has no BOS token id")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    heads = config.num_attention_heads
    return LoadedModel(
        name=name, model=model, tokenizer=tokenizer, device=dev, dtype=dt,
        num_layers=config.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab_size=config.vocab_size, max_positions=position_limit(config),
        bos_id=int(bos), eos_id=None if eos is None else int(eos),
        inv_freq=rotary.inv_freq.detach().to("cpu", torch.float32).clone(), weights=weights)


def _linear_bytes(model) -> int:
    """Bytes the linear layers' weights take (as loaded, or as weights.py's layers hold them)."""
    return sum(layer_bytes(module) for module in model.modules())
