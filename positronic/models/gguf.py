"""A `.gguf` file as a model: read once through transformers' GGUF loader (which de-quantizes
every tensor, ~30 s for a 135M model, minutes for billions of parameters) and written as a
safetensors directory in the user cache, which every later load reads directly.

A file is untrusted until checked, and it is checked before anything is built from it: its
header is walked within the file's length (every count and length it states against the bytes
left, before any loop runs on it), its tensor table against the file (known types, whole
blocks, each tensor's data where the table's order puts it, inside the file), its metadata
against itself (the keys a model needs, of their types; token ids within the vocabulary; blocks
blk.0 to blk.N-1 exactly as block_count says), the config read from it against its ranges
(checks.check_config, naming the GGUF key), and the model that config describes, built on the
meta device, against the tensor table: every tensor present with its shape, none left over.
So the weights loaded are the file's, or the file is refused with one line.

The conversion is written to a temporary directory, checked again (every tensor present with
its shape, as transformers' loading report and the directory's own safetensors header say) and
only then renamed into the cache, keyed by the file's sha256: a changed file is converted again,
and an entry that fails the same check is not used. sha256 reads the whole file (1.35 GB/s here:
0.07 s for the embedded 98 MB model), cheap beside reading the conversion, which is larger."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import transformers
from transformers import AutoTokenizer

from ..util import atomic_write_dir, error_line, quiet_transformers
from .checks import (MAX_LAYERS, ModelError, check_config, check_loading_info, check_tensors, model_tensors,
                     printable, stored_shapes)

HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_MIN_ENTRY_BYTES, _MIN_TENSOR_BYTES = 13, 24  # empty name + type + one byte of value; empty name + n_dims + type + offset
_REQUIRED = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.layer_norm_rms_epsilon")  # what llama.cpp itself will not load a decoder without
_INTEGER_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
                 "attention.head_count_kv", "attention.key_length", "attention.value_length",
                 "rope.dimension_count", "vocab_size")
_NUMBER_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")
CONFIG_KEYS = {  # config field -> the GGUF key transformers reads it from ({arch}: the file's architecture)
    "num_hidden_layers": "{arch}.block_count", "max_position_embeddings": "{arch}.context_length",
    "hidden_size": "{arch}.embedding_length", "intermediate_size": "{arch}.feed_forward_length",
    "num_attention_heads": "{arch}.attention.head_count", "num_key_value_heads": "{arch}.attention.head_count_kv",
    "head_dim": "{arch}.attention.key_length", "rope_theta": "{arch}.rope.freq_base",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon", "vocab_size": "{arch}.vocab_size",
    "bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
_UNREAD = {  # tensors llama.cpp writes that transformers' GGUF loader passes over, and what that would cost
    "rope_freqs.weight": "llama.cpp's RoPE frequency factors (Llama 3.1+ RoPE scaling), which transformers' GGUF "
                         "loader does not read: the model would rotate its keys with other frequencies",
}


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array: its item type and length (its items are not kept)."""
    item_type: int
    count: int


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch's order (the file states ggml's: fastest-moving first)
    ggml_type: int
    start: int  # of its data, from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file states, walked and checked against its length (read_header)."""
    path: Path
    fields: dict  # key -> int | float | bool | str | GGUFArray
    types: dict  # key -> its GGUFValueType
    tensors: dict  # name -> GGUFTensor, in the table's order

    @property
    def architecture(self) -> str:
        return self.fields["general.architecture"]


def cache_root() -> Path:
    """$POSITRONIC_CACHE, or ~/.cache/positronic."""
    return Path(os.environ.get("POSITRONIC_CACHE") or Path.home() / ".cache" / "positronic")


def gguf_cache(gguf: Path, name: str | None = None, *, label: str | None = None) -> Path:
    """Directory of the converted `gguf` (config, model.safetensors, tokenizer) under cache_root();
    converts it on first use, and again when the file's sha256 differs from the conversion's or
    the directory fails its check. name: the directory's name (default: from the file's name and
    path). Everything the module's docstring lists is checked before the slow de-quantization."""
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise ModelError(f"GGUF file {str(gguf)!r} does not exist or is not a regular file")
    source = {"gguf": gguf.name, "bytes": gguf.stat().st_size, "sha256": sha256_of(gguf)}
    if name is None:
        digest = hashlib.sha256(str(gguf).encode()).hexdigest()[:12]
        name = f"gguf-{gguf.stem}-{digest}"
    target = cache_root() / name
    if target.is_dir() and _entry_problem(target, source) is None:
        return target
    header = read_header(gguf)
    config = gguf_config(header)
    print(f"converting {label or gguf.name} GGUF to safetensors (one time)…", file=sys.stderr, flush=True)
    where = f"GGUF file {str(gguf)!r}"
    try:
        with quiet_transformers(progress=True):
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, config=config, dtype=_conversion_dtype(header),
                output_loading_info=True)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # what the checks above did not foresee: one line, not a traceback
        raise ModelError(f"cannot convert {where}: {error_line(e)}") from None
    check_loading_info(info, where)
    # transformers < 5.18 gives a llama-family GGUF's tokenizer the bos token as its eos
    # (GGUFLlamaConverter: tokens[bos_token_id]); the config read from the file has the right id
    if isinstance(config.eos_token_id, int) and tokenizer.eos_token_id != config.eos_token_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    weights = model.state_dict()

    def write(tmp: Path) -> None:
        import safetensors.torch
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        # each tied tensor once, under the name model_tensors lists (the entry's check below)
        safetensors.torch.save_file({key: weights[key].contiguous() for key in model_tensors(model.config)},
                                    str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        if sha256_of(gguf) != source["sha256"]:  # the entry would be stamped with contents it was not made from
            raise ModelError(f"{where} changed while it was converted: load it again")
        (tmp / "source.json").write_text(json.dumps(source))
        problem = _entry_problem(tmp, source)
        if problem is not None:
            raise ModelError(f"the conversion of {where} failed its check: {problem}")

    atomic_write_dir(target, write)  # a refused conversion leaves no directory behind, not even an empty cache
    return target


def gguf_config(header: GGUFHeader):
    """The transformers config of the checked `header`'s file, checked in its turn: its ranges
    (naming the GGUF keys) and the model it describes against the file's tensor table."""
    arch, where = header.architecture, f"GGUF file {str(header.path)!r}"
    try:
        config = transformers.AutoConfig.from_pretrained(str(header.path.parent), gguf_file=header.path.name)
    except Exception as e:  # not a GGUF transformers can read: one line, not a traceback
        raise ModelError(f"cannot read {where}: {error_line(e)}") from None
    stated = header.fields.get(f"{arch}.attention.key_length")
    if stated is not None:  # transformers reads no head width for qwen2/qwen3: the class default (128) stood
        config.head_dim = stated
    fields = {field: key.format(arch=printable(arch)) for field, key in CONFIG_KEYS.items()}
    if stated is None and f"{arch}.rope.dimension_count" in header.fields:
        fields["head_dim"] = f"{printable(arch)}.rope.dimension_count"
    check_config(config, fields)
    names = _tensor_names(arch, config.num_hidden_layers)
    need = {}
    for key, shape in model_tensors(config).items():
        module, _, suffix = key.rpartition(".")
        gguf_name = names.get_name(module)
        if gguf_name is None:
            raise ModelError(f"{where}: no GGUF tensor name is known for {key} of a {arch!r} model")
        need[f"{gguf_name}.{suffix}"] = shape
    for unread, why in _UNREAD.items():
        if unread in header.tensors and unread not in need:
            raise ModelError(f"{where} holds {unread}, {why}")
    check_tensors({t.name: t.shape for t in header.tensors.values()}, need, where, "its header")
    return config


def _conversion_dtype(header: GGUFHeader):
    """The dtype that holds every tensor of the file exactly: its float type where every tensor
    has the same one, else float32 (transformers would take the half type of a file whose norms
    are F32 and round them; de-quantized blocks are float32)."""
    import torch
    from gguf import GGMLQuantizationType as Q
    types = {tensor.ggml_type for tensor in header.tensors.values()}
    return {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(types.pop(), torch.float32) if len(types) == 1 \
        else torch.float32


def _tensor_names(arch: str, blocks: int):
    import gguf
    arch_id = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch), None)
    if arch_id is None:
        raise ModelError(f"GGUF architecture {arch!r} is not one the gguf package names tensors for")
    return gguf.get_tensor_name_map(arch_id, blocks)


def read_header(path: Path) -> GGUFHeader:
    """The header of GGUF file `path`, walked within the file's length and checked (the module's
    docstring); ModelError names the first thing wrong. Reads the header and tensor table only:
    milliseconds, whatever the counts it states."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ModelError(f"cannot read GGUF file {str(path)!r}: {size} bytes, shorter than a GGUF header")
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = _Walk(path, data).header()
    _check_metadata(header)
    return header


class _Walk:
    """A cursor over the file that refuses to read, or loop, past what is left of it."""

    def __init__(self, path: Path, data):
        self.path, self.data, self.pos = path, data, 0

    def fail(self, problem: str) -> ModelError:
        return ModelError(f"cannot read GGUF file {str(self.path)!r}: {problem}")

    def skip(self, size: int, what: str) -> int:
        left = len(self.data) - self.pos
        if size > left:
            raise self.fail(f"{what} at byte {self.pos} needs {size} bytes, {left} are left")
        self.pos += size
        return self.pos - size

    def unpack(self, fmt: str, what: str):
        start = self.skip(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.data, start)

    def string(self, what: str) -> str:
        (length,) = self.unpack("<Q", f"the length of {what}")
        start = self.skip(length, what)
        try:
            return self.data[start:start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, kind: int, key: str):
        from gguf import GGUFValueType as T
        formats = _formats()
        if kind in formats:
            return self.unpack(formats[kind], key)[0]
        if kind == T.STRING:
            return self.string(key)
        if kind != T.ARRAY:
            raise self.fail(f"{key} has value type {kind}, which GGUF does not define")
        item, count = self.unpack("<IQ", f"the type and length of {key}")
        left = len(self.data) - self.pos
        if item in formats:
            self.skip(count * struct.calcsize(formats[item]), f"{key}'s {count} items")
        elif item == T.STRING:
            if count * 8 > left:  # each string takes its 8-byte length at least
                raise self.fail(f"{key} states {count} strings, more than the {left} bytes left can hold")
            for i in range(count):
                self.string(f"item {i} of {key}")
        else:
            raise self.fail(f"{key} is an array of value type {item}, which is not read (numbers or strings)")
        return GGUFArray(item, count)

    def header(self) -> GGUFHeader:
        from gguf import GGML_QUANT_SIZES, GGUFValueType as T
        if bytes(self.data[:4]) != b"GGUF":
            raise self.fail("it does not start with GGUF's magic bytes")
        self.pos = 4
        (version, tensor_count, entry_count) = self.unpack("<IQQ", "the header")
        if version not in (2, 3):
            raise self.fail(f"GGUF version {version} is not read (versions 2 and 3, little-endian)")
        size = len(self.data)
        if entry_count * _MIN_ENTRY_BYTES + tensor_count * _MIN_TENSOR_BYTES > size - HEADER_BYTES:
            raise self.fail(f"its header states {entry_count} metadata entries and {tensor_count} tensors, more "
                            f"than {size} bytes can hold")
        fields, types = {}, {}
        for i in range(entry_count):
            key = self.string(f"metadata key {i}")
            if key in fields:
                raise self.fail(f"metadata key {key!r} is stated twice")
            (kind,) = self.unpack("<I", f"the value type of {printable(key)}")
            fields[key], types[key] = self.value(kind, printable(key)), kind
        alignment = fields.get("general.alignment", 32)
        if types.get("general.alignment", T.UINT32) != T.UINT32 or alignment < 1 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment = {alignment!r} is not a power of two (a uint32)")
        table = []
        for i in range(tensor_count):
            name = self.string(f"the name of tensor {i}")
            where = f"tensor {printable(name)}"
            (dims,) = self.unpack("<I", f"the dimension count of {where}")
            if not 1 <= dims <= 4:
                raise self.fail(f"{where} has {dims} dimensions: GGUF tensors have 1 to 4")
            shape = self.unpack(f"<{dims}Q", f"the dimensions of {where}")
            ggml_type, offset = self.unpack("<IQ", f"the type and offset of {where}")
            table.append((name, shape, ggml_type, offset))
        tensors, end = {}, 0  # `end`: where the previous tensor's data ends, from the data section's start
        data_start = -(-self.pos // alignment) * alignment
        readable = _readable_types()
        for name, shape, ggml_type, offset in table:
            where = f"tensor {printable(name)}"
            if name in tensors:
                raise self.fail(f"{where} is stated twice")
            if ggml_type not in readable:
                raise self.fail(f"{where} has ggml type {_type_name(ggml_type)}, which transformers' GGUF loader "
                                f"does not read ({', '.join(_type_name(t) for t in sorted(readable))})")
            if min(shape) < 1:
                raise self.fail(f"{where} has a dimension of 0: {list(shape)}")
            block, block_bytes = GGML_QUANT_SIZES[ggml_type]
            if shape[0] % block:
                raise self.fail(f"{where}'s rows of {shape[0]} values are not whole {_type_name(ggml_type)} blocks "
                                f"of {block}")
            nbytes = math.prod(shape) // block * block_bytes
            expected = -(-end // alignment) * alignment
            if offset != expected:  # as llama.cpp: each tensor right after the one before, so none overlap
                raise self.fail(f"{where}'s data starts at offset {offset}; the table's order puts it at {expected}")
            end = offset + nbytes
            if data_start + end > size:
                raise self.fail(f"{where}'s data (bytes {data_start + offset} to {data_start + end}) runs past the "
                                f"end of the file ({size} bytes)")
            tensors[name] = GGUFTensor(name, tuple(reversed(shape)), ggml_type, data_start + offset, nbytes)
        return GGUFHeader(self.path, fields, types, tensors)


def _check_metadata(header: GGUFHeader) -> None:
    """The metadata a decoder needs, of its types; token ids within the vocabulary; the blocks
    in the tensor table exactly those block_count states (10^6 would have transformers build a
    million layers before anything looked at a tensor)."""
    from gguf import GGUFValueType as T
    fields, types, where = header.fields, header.types, f"GGUF file {str(header.path)!r}"
    integers = {T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64}
    if types.get("general.architecture") != T.STRING:
        raise ModelError(f"{where} has no general.architecture (a string)")
    arch = header.architecture
    shown = printable(arch)
    for key in _REQUIRED:
        if f"{arch}.{key}" not in fields:
            raise ModelError(f"{where} lacks {shown}.{key}, which a {arch!r} model needs")
    for keys, kinds, what in ((_INTEGER_KEYS, integers, "an integer"), (_NUMBER_KEYS, integers | {T.FLOAT32, T.FLOAT64},
                                                                          "a number")):
        for key in (f"{arch}.{k}" for k in keys):
            if key in types and types[key] not in kinds:
                raise ModelError(f"{where}: {printable(key)} = {_shown(fields[key])} is not {what}")
    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, GGUFArray) or tokens.item_type != T.STRING or tokens.count < 1:
        raise ModelError(f"{where} has no tokenizer.ggml.tokens (an array of strings)")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in fields and (not isinstance(fields[key], GGUFArray) or fields[key].count != tokens.count):
            raise ModelError(f"{where}: {key} = {_shown(fields[key])} is not one entry per token "
                             f"(tokenizer.ggml.tokens has {tokens.count})")
    vocab = fields.get(f"{arch}.vocab_size", tokens.count)
    if vocab != tokens.count:
        raise ModelError(f"{where}: {shown}.vocab_size = {vocab}, but tokenizer.ggml.tokens has {tokens.count} "
                         "tokens")
    if "tokenizer.ggml.bos_token_id" not in fields:
        raise ModelError(f"{where} lacks tokenizer.ggml.bos_token_id: the brain puts BOS first, as the attention sink")
    for key, value in fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and (
                types[key] not in integers or not 0 <= value < tokens.count):
            raise ModelError(f"{where}: {printable(key)} = {_shown(value)} is not a token id: the vocabulary has "
                             f"{tokens.count} (0 to {tokens.count - 1})")
    blocks = fields[f"{arch}.block_count"]
    if not 1 <= blocks <= MAX_LAYERS:
        raise ModelError(f"{where}: {shown}.block_count = {blocks} is out of range: 1 to {MAX_LAYERS}")
    found = {int(m.group(1)) for name in header.tensors if (m := re.match(r"blk\.(\d+)\.", name))}
    if found != set(range(blocks)):
        held = f"blocks {min(found)} to {max(found)} ({len(found)})" if found else "no blocks"
        raise ModelError(f"{where}: {shown}.block_count = {blocks}, but its tensors hold {held}")


def _entry_problem(directory: Path, source: dict) -> str | None:
    """None if `directory` is a complete conversion of the file `source` describes (its sha256):
    the config's model has every tensor in model.safetensors, with its shape, and nothing else,
    and the tokenizer is there; else what is wrong."""
    try:
        if json.loads((directory / "source.json").read_text()) != source:
            return "it was converted from another file"
        config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
        have = stored_shapes([directory / "model.safetensors"])
        check_tensors(have, model_tensors(config), f"converted directory {str(directory)!r}")
        for file in ("tokenizer.json", "tokenizer_config.json"):
            if not (directory / file).is_file():
                return f"it has no {file}"
    except Exception as e:  # anything unreadable there is a reason to convert again
        return error_line(e)
    return None


def sha256_of(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _readable_types() -> set[int]:
    """The ggml types transformers' GGUF loader de-quantizes: from 5.18 its own kernels (fewer
    than gguf's: no Q5_0, say), before that gguf's."""
    from gguf import GGMLQuantizationType as Q
    floats = {Q.F32, Q.F16, Q.BF16}
    try:
        from transformers.integrations.gguf.dequant import GGML_BLOCK
        return floats | set(GGML_BLOCK)
    except ImportError:
        from gguf.quants import _type_traits
        return floats | set(_type_traits)


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return str(ggml_type)


def _shown(value) -> str:
    return f"an array of {value.count}" if isinstance(value, GGUFArray) else repr(value)


@functools.cache
def _formats() -> dict[int, str]:
    """struct formats of GGUF's fixed-size value types (gguf is imported on first use: 0.16 s)."""
    from gguf import GGUFValueType as T
    return {T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
            T.FLOAT32: "<f", T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d"}

