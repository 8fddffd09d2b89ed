"""positronic.models.gguf: `--model some.gguf`.

A GGUF written here from a random family model (random:qwen3, random:qwen2; no download: the
`write_gguf` fixture in conftest.py writes llama.cpp's layout, unquantized) is converted once
through transformers' GGUF loader into $POSITRONIC_CACHE and loads as the same model (class,
logits, tokenizer, shape facts); the brain runs on it.

A file whose header lies, or whose tensors do not cover the model, is refused with one line
naming the key or the tensor, in milliseconds, and leaves nothing in the cache. The cache is
keyed by the file's sha256, and an entry is checked before it is used.

The fuzzer mutates a valid file's header fields, its tensor table's entries, whole keys and
tensors, bytes of its header and its length: every case loads with exactly the file's weights
or is refused with one line, leaves no cache entry when refused, and takes under a second of
CPU. POSITRONIC_GGUF_FUZZ_EXAMPLES sets how many cases (default 60; 2000 with
POSITRONIC_LONG_TESTS=1); the figures are printed at the end (`pytest -s`), a long run's are
in docs/models.md.
"""

import collections
import gc
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType as T, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.version import Version

from positronic.brain.loop import Brain, BrainConfig
from positronic.models import ModelError, load_model

FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# transformers < 5.18 turns a GGUF "gpt2" tokenizer whose merges come out empty into an
# AttributeError (GGUFQwen2Converter: `if not merges` falls back to the absent bpe_ranks);
# 5.18 rewrote the GGUF tokenizer loading (transformers/integrations/gguf/).
pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.18"),
                                reason="transformers < 5.18 cannot load a GGUF tokenizer with no merges")
EXAMPLES = int(os.environ.get("POSITRONIC_GGUF_FUZZ_EXAMPLES",
                              "2000" if os.environ.get("POSITRONIC_LONG_TESTS") else "60"))
CASE_CPU_SECONDS = 1.0
OUTCOMES: collections.Counter = collections.Counter()
WRAPPED: collections.Counter = collections.Counter()  # those errors, what each said


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory, write_gguf):
    """(the random family model, the same model loaded from a GGUF of it), the conversion in a
    $POSITRONIC_CACHE of its own."""
    family = request.param
    original = load_model(f"random:{family}", device="cpu", dtype="float32")
    folder = tmp_path_factory.mktemp(f"gguf-{family}")
    path = write_gguf(original, folder / f"random-{family}.gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POSITRONIC_CACHE", str(folder / "cache"))
        loaded = load_model(str(path), device="cpu", dtype="float32")
    return original, loaded, folder


def test_a_gguf_of_a_family_loads_as_the_same_model(pair):
    original, loaded, folder = pair
    family = original.model.config.model_type
    assert type(loaded.model).__name__ == type(original.model).__name__ == FAMILIES[family]
    assert list((folder / "cache").iterdir()), "converted into $POSITRONIC_CACHE"
    facts = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_positions", "bos_id", "eos_id")
    assert {f: getattr(loaded, f) for f in facts} == {f: getattr(original, f) for f in facts}
    torch.testing.assert_close(loaded.inv_freq, original.inv_freq, rtol=0, atol=0)
    ids = torch.tensor([[original.bos_id, *original.encode("The quick brown fox, é 漢")]])
    with torch.inference_mode():
        expected, got = original.model(ids).logits, loaded.model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    text = "Hello world"
    assert loaded.encode(text) == original.encode(text)
    mixed = " two  spaces\nand é 漢字 <s></s><r300>"
    assert loaded.encode(mixed) == original.encode(mixed)
    assert loaded.decode(loaded.encode(mixed)) == mixed
    assert json.loads(loaded.tokenizer.backend_tokenizer.to_str())["model"]["merges"] == []
    assert sorted(loaded.tokenizer.all_special_ids) == sorted(original.tokenizer.all_special_ids)


def test_the_brain_runs_on_a_gguf_model(pair):
    _, lm, _ = pair
    config = BrainConfig(policy="streaming", budget=64, seed=1)  # 64: streaming's 32-row recent window + room to cull
    brain = Brain.start(lm, [lm.bos_id] + lm.encode("some text " * 5), config)
    for _ in range(60):
        record = brain.step()
        assert not record.rebuilt, record
        assert record.live_length <= 64
    assert brain.state.mirror.ledger.count("culled") > 0
    brain.state.check(deep=True)


# -- files that lie ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(write_gguf, tmp_path_factory):
    """A valid GGUF of random:qwen3 (2 blocks, vocab 512, 0.5 MB), loaded once here so that the
    tests after it find transformers' lazy imports done."""
    folder = tmp_path_factory.mktemp("gguf-base")
    path = write_gguf(load_model("random:qwen3", device="cpu", dtype="float32"), folder / "base.gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POSITRONIC_CACHE", str(folder / "cache"))
        load_model(str(path), device="cpu", dtype="float32")
    return path


def _rewrite(src: Path, dst: Path, *, drop_keys=(), drop_tensors=(), keys=None, tensors=None) -> Path:
    """`src` written again by GGUFWriter: keys dropped or set (key -> (value, type[, item type])),
    tensors dropped or added (name -> float32 array, numpy's order)."""
    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    keys = keys or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys or key in keys:
            continue
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1] if kind == T.ARRAY else None)
    for key, (value, kind, *item) in keys.items():
        writer.add_key_value(key, value, kind, sub_type=item[0] if item else None)
    for tensor in reader.tensors:
        if tensor.name not in drop_tensors:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _poke(path: Path, value, *, key: str | None = None, tensor: int | None = None, part: int = -1,
          index: int = 0, reader: GGUFReader | None = None) -> Path:
    """Overwrite one number of `path` in place: the value of metadata `key` (GGUF.version,
    GGUF.tensor_count and GGUF.kv_count are the header's own; `part`: which of the entry's
    numbers, -1 its value, 4 an array's length), or part `part` of tensor `tensor`'s table entry
    (2 its dimension count, 3 its dimensions (`index`), 4 its ggml type, 5 its data offset).
    `value` wraps around to the field's width, as a file's bytes would hold it. `reader`: the
    file opened "r+" already (several pokes, each where the valid file had its number)."""
    reader = reader or GGUFReader(path, "r+")
    if key is not None:
        field = reader.fields[key]
        number = field.parts[field.data[0] if part == -1 else part]
    else:
        number = reader.tensors[tensor % len(reader.tensors)].field.parts[part]
    bits = number.dtype.itemsize * 8
    if np.issubdtype(number.dtype, np.integer):
        wrapped = int(value) % 2**bits
        value = wrapped - 2**bits if np.issubdtype(number.dtype, np.signedinteger) and wrapped >= 2**(bits - 1) \
            else wrapped
    number[index % len(number)] = value
    reader.data.flush()
    return path


def _copy(base: Path, folder: Path) -> Path:
    return Path(shutil.copy(base, folder / "lying.gguf"))


LIES = {  # name -> (make the file from the valid one, what the one line says)
    "tensor count 0": (lambda f: _poke(f, 0, key="GGUF.tensor_count"),
                       "qwen3.block_count = 2, but its tensors hold no blocks"),
    "tensor count 2^40": (lambda f: _poke(f, 2**40, key="GGUF.tensor_count"), "1099511627776 tensors, more than"),
    "kv count 2^40": (lambda f: _poke(f, 2**40, key="GGUF.kv_count"), "1099511627776 metadata entries"),
    "token count 2^40": (lambda f: _poke(f, 2**40, key="tokenizer.ggml.tokens", part=4),
                         "tokenizer.ggml.tokens states 1099511627776 strings, more than the"),
    "no blk.1.ffn_down.weight": (lambda f: _rewrite(f, f.with_name("cut.gguf"), drop_tensors={"blk.1.ffn_down.weight"}),
                                 "lacks tensor blk.1.ffn_down.weight, which the model needs"),
    "BOS id 2^31-1": (lambda f: _poke(f, 2**31 - 1, key="tokenizer.ggml.bos_token_id"),
                      r"tokenizer.ggml.bos_token_id = 2147483647 is not a token id: the vocabulary has 512"),
    "EOS id 2^31-1": (lambda f: _poke(f, 2**31 - 1, key="tokenizer.ggml.eos_token_id"),
                      r"tokenizer.ggml.eos_token_id = 2147483647 is not a token id"),
    "head_count 0": (lambda f: _poke(f, 0, key="qwen3.attention.head_count"),
                     r"num_attention_heads \(qwen3.attention.head_count\) = 0 is out of range"),
    "head_count_kv 3": (lambda f: _poke(f, 3, key="qwen3.attention.head_count_kv"),
                        r"= 4 is not a multiple of num_key_value_heads \(qwen3.attention.head_count_kv\) = 3"),
    "key_length 0": (lambda f: _poke(f, 0, key="qwen3.attention.key_length"),
                     r"head_dim \(qwen3.attention.key_length\) = 0 is out of range"),
    "embedding_length 7": (lambda f: _poke(f, 7, key="qwen3.embedding_length"),
                           r"tensor token_embd.weight has shape \[512, 64\], its header makes it \[512, 7\]"),
    "block_count 10^6": (lambda f: _poke(f, 10**6, key="qwen3.block_count"),
                         "qwen3.block_count = 1000000 is out of range: 1 to 1024"),
    "block_count 1": (lambda f: _poke(f, 1, key="qwen3.block_count"),
                      r"qwen3.block_count = 1, but its tensors hold blocks 0 to 1 \(2\)"),
    "block_count 3": (lambda f: _poke(f, 3, key="qwen3.block_count"), "block_count = 3, but its tensors hold blocks"),
    "vocab_size 600": (lambda f: _poke(f, 600, key="qwen3.vocab_size"),
                       "qwen3.vocab_size = 600, but tokenizer.ggml.tokens has 512 tokens"),
    "rope base nan": (lambda f: _poke(f, float("nan"), key="qwen3.rope.freq_base"),
                      r"rope_theta \(qwen3.rope.freq_base\) = nan is out of range"),
    "block_count a string": (lambda f: _rewrite(f, f.with_name("s.gguf"), keys={"qwen3.block_count": ("2", T.STRING)}),
                             "qwen3.block_count = '2' is not an integer"),
    "no embedding_length": (lambda f: _rewrite(f, f.with_name("k.gguf"), drop_keys={"qwen3.embedding_length"}),
                            "lacks qwen3.embedding_length, which a 'qwen3' model needs"),
    "a tensor left over": (lambda f: _rewrite(f, f.with_name("x.gguf"),
                                              tensors={"blk.0.extra.weight": np.ones(8, np.float32)}),
                           "holds tensor blk.0.extra.weight, which the model does not use"),
    "a tensor named with a newline": (lambda f: _rewrite(f, f.with_name("n.gguf"),
                                                         tensors={"blk.0.a\nb.weight": np.ones(8, np.float32)}),
                                      r"holds tensor 'blk.0.a\\nb.weight', which the model does not use"),
    "rope_freqs.weight": (lambda f: _rewrite(f, f.with_name("r.gguf"),
                                             tensors={"rope_freqs.weight": np.ones(16, np.float32)}),
                          "rope_freqs.weight, llama.cpp's RoPE frequency factors"),
    "a dimension of 0": (lambda f: _poke(f, 0, tensor=3, part=3), r"tensor blk.0.attn_v.weight has a dimension of 0"),
    "5 dimensions": (lambda f: _poke(f, 5, tensor=3, part=2), "tensor blk.0.attn_v.weight has 5 dimensions"),
    "overlapping data": (lambda f: _poke(f, 0, tensor=1, part=5),
                         "tensor blk.0.attn_q.weight's data starts at offset 0; the table's order puts it at 131072"),
    "type I32": (lambda f: _poke(f, int(Q.I32), tensor=0, part=4),  # integers: no loader takes them for weights
                 "tensor token_embd.weight has ggml type I32, which transformers' GGUF loader does not read"),
    "cut short": (lambda f: (os.truncate(f, f.stat().st_size - 100), f)[1], "runs past the end of the file"),
    "header cut short": (lambda f: (os.truncate(f, 5000), f)[1],
                         r"item \d+ of tokenizer.ggml.tokens at byte \d+ needs \d+ bytes, \d+ are left"),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_file_that_lies_is_refused_in_one_line_naming_what(lie, base, tmp_path, monkeypatch, one_line_error):
    cache = tmp_path / "cache" / "positronic"
    monkeypatch.setenv("POSITRONIC_CACHE", str(cache))
    make, expected = LIES[lie]
    path = make(_copy(base, tmp_path))
    # refused by the checks, before the slow part (transformers' de-quantizing load) begins
    started, load = [], transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: started.append(args) or load(*args, **kwargs))
    message = one_line_error(ModelError, str(path), device="cpu", dtype="float32")
    assert re.search(expected, message), message
    assert not (tmp_path / "cache").exists(), "no cache entry, no cache directory"
    assert not started, "the file was refused only after its conversion began"


def test_a_block_count_of_a_million_is_refused_before_a_layer_is_built(base, tmp_path, monkeypatch):
    """transformers built a million layers (5 minutes, then std::bad_alloc) before looking at a tensor."""
    monkeypatch.setenv("POSITRONIC_CACHE", str(tmp_path / "cache"))
    path = _poke(_copy(base, tmp_path), 10**6, key="qwen3.block_count")
    started, load = [], transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: started.append(args) or load(*args, **kwargs))
    with pytest.raises(ModelError, match="block_count = 1000000"):
        load_model(str(path), device="cpu")
    assert not started, "transformers was asked to build the model"


def test_a_file_changed_in_place_is_converted_again(base, tmp_path, monkeypatch, capfd):
    """Same path, size and mtime, another weight: the cache is keyed by the file's sha256."""
    monkeypatch.setenv("POSITRONIC_CACHE", str(tmp_path / "cache"))
    path = _copy(base, tmp_path)
    first = load_model(str(path), device="cpu", dtype="float32")
    stat = path.stat()
    reader = GGUFReader(path, "r+")
    reader.tensors[0].data[0, 0] = 123.0  # token_embd.weight[0, 0]
    reader.data.flush()
    del reader
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    capfd.readouterr()
    again = load_model(str(path), device="cpu", dtype="float32")
    assert "converting" in capfd.readouterr().err
    assert first.model.model.embed_tokens.weight[0, 0] != 123.0
    assert again.model.model.embed_tokens.weight[0, 0] == 123.0
    assert len(list((tmp_path / "cache").iterdir())) == 1, "the entry of the file's old contents is replaced"


@pytest.mark.parametrize("damage", ["a tensor removed", "safetensors cut short", "another file's source.json"])
def test_a_cache_entry_that_fails_its_check_is_converted_again(damage, base, tmp_path, monkeypatch, capfd):
    import safetensors.torch
    monkeypatch.setenv("POSITRONIC_CACHE", str(tmp_path / "cache"))
    path = _copy(base, tmp_path)
    first = load_model(str(path), device="cpu", dtype="float32")
    (entry,) = (tmp_path / "cache").iterdir()
    weights = entry / "model.safetensors"
    if damage == "a tensor removed":
        tensors = safetensors.torch.load_file(weights)
        del tensors["model.layers.1.mlp.down_proj.weight"]
        safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
    elif damage == "safetensors cut short":
        os.truncate(weights, weights.stat().st_size // 2)
    else:
        source = json.loads((entry / "source.json").read_text())
        (entry / "source.json").write_text(json.dumps({**source, "sha256": "0" * 64}))
    capfd.readouterr()
    again = load_model(str(path), device="cpu", dtype="float32")
    assert "converting" in capfd.readouterr().err
    for (name, want), got in zip(first.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(got, want), name


# -- the fuzzer --------------------------------------------------------------------------------------

def _fit_int(draw):
    return draw(st.one_of(st.integers(0, 4), st.integers(0, 1100), st.integers(-2**63, 2**64 - 1),
                          st.sampled_from([2**31 - 1, 2**32 - 1, 2**40, 2**63, 2**64 - 1, 10**6, 511, 512, 513]),
                          st.sampled_from([64, 32, 128, 4, 2, 1024])))


NUMBERS = st.one_of(st.floats(width=32), st.sampled_from([0.0, -1.0, float("nan"), float("inf"), 1e-30, 1e30, 1e4]))


@st.composite
def mutations(draw, numeric_keys, tensor_names, data_start, size):
    """A list of what to do to the valid file: ("rewrite", {...}), ("key", key, part, value),
    ("tensor", index, part, dim, value), ("bytes", position, bytes), ("cut", length)."""
    done, keys = [], [(key, kind) for key, kind in numeric_keys if not key.startswith("GGUF.")]  # the header's own
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["key", "key", "key", "tensor", "tensor", "rewrite", "bytes", "cut"]))
        if kind == "key":
            key, kind_of = draw(st.sampled_from(numeric_keys))
            value = draw(NUMBERS) if kind_of in (T.FLOAT32, T.FLOAT64) else _fit_int(draw)
            done.append(("key", key, -1, value))
        elif kind == "tensor":
            part = draw(st.sampled_from([2, 3, 3, 4, 5]))
            value = draw(st.sampled_from([int(t) for t in Q]) | st.integers(0, 64)) if part == 4 else _fit_int(draw)
            done.append(("tensor", draw(st.integers(0, len(tensor_names) - 1)), part, draw(st.integers(0, 3)), value))
        elif kind == "rewrite":
            what = draw(st.sampled_from(["drop tensor", "drop key", "retype key", "add tensor"]))
            if what == "drop tensor":
                done.append(("rewrite", {"drop_tensors": {draw(st.sampled_from(tensor_names))}}))
            elif what == "drop key":
                done.append(("rewrite", {"drop_keys": {draw(st.sampled_from([k for k, _ in keys]))}}))
            elif what == "retype key":
                key, _ = draw(st.sampled_from(keys))
                value = draw(st.sampled_from([("2", T.STRING), (2.0, T.FLOAT32), (True, T.BOOL), ([2], T.ARRAY, T.UINT32),
                                              (2, T.UINT64), (2, T.INT8), (-2, T.INT32)]))
                done.append(("rewrite", {"keys": {key: value}}))
            else:
                name = draw(st.sampled_from(["blk.2.attn_q.weight", "rope_freqs.weight", "output.weight", "extra.weight",
                                             "blk.0.attn_q.bias"]))
                shape = draw(st.sampled_from([(16,), (512, 64), (128,)]))
                done.append(("rewrite", {"tensors": {name: np.full(shape, 0.25, np.float32)}}))
        elif kind == "bytes":
            position = draw(st.integers(0, data_start - 1))
            done.append(("bytes", position, draw(st.binary(min_size=1, max_size=8))))
        else:
            done.append(("cut", draw(st.one_of(st.integers(0, data_start + 64), st.integers(0, size)))))
    return done


def _apply(base: Path, folder: Path, done: list) -> Path:
    """The file `done` makes of `base`: rewrites first (a GGUFWriter file), then the numbers
    poked in place, the bytes, the cut."""
    path = _copy(base, folder)
    rewrites = [step[1] for step in done if step[0] == "rewrite"]
    if rewrites:  # all at once: a tensor added twice is added once
        merged = {"drop_keys": set(), "drop_tensors": set(), "keys": {}, "tensors": {}}
        for rewrite in rewrites:
            for what, value in rewrite.items():
                merged[what].update(value)
        path = _rewrite(path, folder / "rewritten.gguf", **merged)
    pokes = [step for step in done if step[0] in ("key", "tensor")]
    if pokes:
        reader = GGUFReader(path, "r+")
        for step in pokes:
            if step[0] == "key" and step[1] in reader.fields:  # (a rewrite may have dropped it)
                _poke(path, step[3], key=step[1], part=step[2], reader=reader)
            elif step[0] == "tensor" and reader.tensors:
                _poke(path, step[4], tensor=step[1], part=step[2], index=step[3], reader=reader)
        del reader
    for step in done:
        if step[0] == "bytes":
            with open(path, "r+b") as file:
                file.seek(step[1])
                file.write(step[2])
        elif step[0] == "cut":
            os.truncate(path, min(step[1], path.stat().st_size))
    return path


def _assert_the_files_weights(lm, path: Path) -> None:
    """Every parameter of `lm` is a tensor of the file, de-quantized as its type says, and
    every tensor of the file is a parameter."""
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, lm.num_layers)
    params = lm.model.state_dict()
    gguf_name = {}
    for key in params:
        module, _, suffix = key.rpartition(".")
        gguf_name[key] = f"{names.get_name(module)}.{suffix}"
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    tied = lm.model.config.tie_word_embeddings
    assert set(tensors) == {name for key, name in gguf_name.items() if not (tied and key == "lm_head.weight")}
    for key, param in params.items():
        name = "token_embd.weight" if tied and key == "lm_head.weight" else gguf_name[key]
        tensor = tensors[name]
        want = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        assert torch.equal(param, want.reshape(param.shape)), f"{key} is not the file's {name}"
    for field, key in (("num_layers", f"{arch}.block_count"), ("vocab_size", "tokenizer.ggml.tokens")):
        stated = reader.fields[key]
        assert getattr(lm, field) == (len(stated.data) if key.endswith("tokens") else stated.contents())


def _load(path: Path, cache: Path):
    """(the LoadedModel or the ModelError, the CPU seconds the load took) with $POSITRONIC_CACHE `cache`."""
    os.environ["POSITRONIC_CACHE"] = str(cache)
    gc.disable()  # collecting the earlier cases' garbage (cycles in transformers' models) is not this load's time
    cpu = time.process_time()
    try:
        outcome = load_model(str(path), device="cpu", dtype="float32")
    except ModelError as e:
        outcome = e
    finally:
        seconds = time.process_time() - cpu
        gc.enable()
    return outcome, seconds


@pytest.fixture(scope="module")
def fuzz_summary():
    start = time.perf_counter()
    yield
    total = sum(OUTCOMES[k] for k in ("loaded", "refused"))
    print(f"\ngguf fuzz: {total} cases in {time.perf_counter() - start:.1f} s; "
          + ", ".join(f"{k} {v}" for k, v in sorted(OUTCOMES.items())))
    for message, count in WRAPPED.most_common():
        print(f"  {count} x {message}")


@pytest.mark.long  # the fuzzer: in make test, not in make test-fast
def test_fuzzed_gguf_files_load_exactly_or_are_refused_in_one_line(base, fuzz_summary):
    reader = GGUFReader(base)
    numeric = sorted((key, field.types[0]) for key, field in reader.fields.items()
                     if len(field.types) == 1 and field.types[0] not in (T.STRING, T.ARRAY))
    tensor_names = [tensor.name for tensor in reader.tensors]
    data_start, size = reader.tensors[0].data_offset, base.stat().st_size
    del reader

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("POSITRONIC_LONG_TESTS"),
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(done=mutations(numeric, tensor_names, data_start, size))
    def case(done):
        with tempfile.TemporaryDirectory() as folder:
            folder = Path(folder)
            path = _apply(base, folder, done)
            outcome, seconds = _load(path, folder / "cache")
            if seconds >= CASE_CPU_SECONDS:  # a neighbour's load on this machine, or this case: once more tells
                shutil.rmtree(folder / "cache", ignore_errors=True)
                outcome, seconds = _load(path, folder / "cache")
            assert seconds < CASE_CPU_SECONDS, (done, seconds)
            if isinstance(outcome, ModelError):
                message = str(outcome)
                assert message and "\n" not in message, (done, message)
                assert not (folder / "cache").exists(), (done, message, list((folder / "cache").rglob("*")))
                OUTCOMES["refused"] += 1
                if re.search(r"\b\w+(Error|Exception): ", message):  # another library's error, put in one line
                    OUTCOMES["refused with another library's error"] += 1
                    WRAPPED[message.split(": ", 1)[-1][:120]] += 1
            else:
                _assert_the_files_weights(outcome, path)
                OUTCOMES["loaded"] += 1
            OUTCOMES["max ms"] = max(OUTCOMES["max ms"], round(1000 * seconds))

    previous = os.environ.get("POSITRONIC_CACHE")
    try:
        case()
    finally:
        if previous is None:
            os.environ.pop("POSITRONIC_CACHE", None)
        else:
            os.environ["POSITRONIC_CACHE"] = previous
    assert OUTCOMES["loaded"] >= 1, "the file with no mutation loads"
