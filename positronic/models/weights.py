"""The linear layers' weights in the format the user asks for: `--weights float32 | bfloat16 |
int8 | int8-weight-only | int4 | auto` (docs/weights.md has the measured speeds and perplexities).

A decode step on a CPU reads every weight once, so fewer bytes a weight is less time a token
(how much less depends on what else a tick spends: bench/results/weights.md). Each format is a
layer type of its own that replaces `nn.Linear` (the projections, the MLP, the logits; norms
stay as loaded, the embedding too except for int4's `Int8Embedding`):

    int8      Int8Linear: each output row's weights as int8 with one float32 scale (symmetric,
              per channel; 7 bits on a CPU without VNNI, where fbgemm's 8-bit sums would
              saturate); each input row quantized to 8 bits on its own, then fbgemm's integer
              product; each layer's few outlier input channels apart, in float32. An integer sum is exact, so a row's output is the same bits whatever rows come
              with it, in whatever order the kernel adds: batched = alone and decode = prefill
              hold by construction, as RowInvariantLinear makes them hold for float32
              (linear.py). torch's own int8 kernels (`_int_mm`, `_weight_int8pack_mm`, oneDNN's
              qlinear) measured 7-21x slower than fbgemm's here (bench/results/weights.md).
    int8-weight-only
              WeightOnlyInt8Linear: the same int8 weights and row scales, the inputs left
              float32; each output one sum over the inputs of input x weight, in a loop
              inductor writes (`weight_only_product`) that widens the int8 in registers: a
              decode step reads a quarter of float32's bytes. A prompt's rows take a tiled
              kernel with the loop's bits (models/weight_only.py); in a compiled round the loop is
              part of the graph: batched = alone and decode = prefill hold by construction.
    int4      Int4Linear: 4 bits a weight in groups of 32 along the input, a scale and an
              offset per group (the form of llama.cpp's Q4_1), through torch's CPU int4 kernel
              (`_weight_int4pack_mm_for_cpu`) on float32 inputs. A GGUF's Q4_1 blocks come
              back from its float32 conversion exactly (`quantize_int4` finds each block's
              minimum and step as llama.cpp set them), so the file's quantization is kept.
    bfloat16  BFloat16Linear: the weights in bfloat16, each product in bfloat16, the output
              float32 again.
    float32   the layers as loaded (RowInvariantLinear on a CPU).

`auto` is float32 for a float checkpoint and int8 for a GGUF whose linear weights are quantized
(Q8_0, Q4_0, Q4_1, K-quants): int8 is the fastest format measured on the host this was built
on (an AVX2 CPU), 1.5-3% from float32's perplexity, and int4's kernel is 10x slower than
float32's there.
Quantization changes the numbers, not the cache's exactness: every exactness test runs for
every format against that format's own forward (tests/positronic/models/test_weights.py).
"""

from __future__ import annotations

import gc
import warnings

import torch
from torch import nn

from .weight_only import TINY, WeightOnlyInt8Linear, row_scales

FORMATS = ("float32", "bfloat16", "int8", "int8-weight-only", "int4")  # what a loaded model's linear layers can be
WEIGHTS = (*FORMATS, "auto")  # what --weights accepts
GROUP = 32  # int4's group along the input, llama.cpp's block


def has_vnni() -> bool:
    """Whether this CPU adds u8 x s8 products into int32 directly (AVX512-VNNI / AVX-VNNI):
    without it fbgemm pairs them in int16, which saturates for 8-bit inputs."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


# fbgemm adds u8 x s8 products in pairs into int16 on a CPU without VNNI: 255 * 127 * 2 overflows
# it (and saturates silently), 255 * 63 * 2 does not. So there the weights take 7 bits and the
# inputs keep 8: on SmolLM2 (docs/weights.md) 7-bit inputs cost 10% of perplexity, 7-bit
# weights 0.1%. With VNNI both take 8.
WEIGHT_LEVELS = 127 if has_vnni() else 63
ENDS = torch.tensor([[1.0, -1.0]])  # two input columns that pin every product's input range


class Int8Linear(nn.Module):
    """y = x W^T + b with W as int8 per output row and x quantized row by row, by fbgemm
    (module docstring); the few input channels `outliers` names run in float32 beside it.
    `packed` holds W [out, in + 2] (the outlier columns and two columns at the end zero) and
    its per-row scales; `outlier_weight` [outliers, out]; `in_features`, `out_features` as
    nn.Linear's.

    fbgemm's dynamic product quantizes its whole input with one range, its minimum to its
    maximum, so a row's numbers would depend on the rows beside it. Here each row is divided
    by its own largest magnitude and two columns holding +1 and -1 are appended (their weights
    are zero), so every input spans exactly [-1, 1] whatever its rows: one fixed quantization,
    each row's 8 bits its own, the integer sums exact, the output multiplied back by the row's
    magnitude. The outlier channels (a decoder's inputs carry a few channels ten times the
    others: the largest of a calibration forward, `calibrate`) are taken out first, or they
    would set every row's range and leave the rest a few levels; their product is written out
    as one broadcast multiply and a sum over the channels (a reduction across rows of the
    product, in channel order for each output), so each row's sum is the same bits whatever rows
    come with it (tests/positronic/models/test_weights.py; a matrix product over four
    columns was a fifth of a decode tick: oneDNN re-laid the weight out on every call). A row's
    output is the same bits alone, beside others, or in a prompt chunk."""

    def __init__(self, packed, in_features: int, out_features: int, bias: torch.Tensor | None,
                 outliers: torch.Tensor | None = None, outlier_weight: torch.Tensor | None = None):
        super().__init__()
        self.packed, self.in_features, self.out_features = packed, in_features, out_features
        self.register_buffer("bias", bias)
        self.register_buffer("outliers", outliers)
        self.register_buffer("outlier_weight", outlier_weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, outliers: torch.Tensor | None = None) -> "Int8Linear":
        weight = linear.weight.detach().float().clone()
        outlier_weight = None
        if outliers is not None and len(outliers):
            outlier_weight = weight[:, outliers].t().contiguous()
            weight[:, outliers] = 0
        else:
            outliers = None
        scale = row_scales(weight, WEIGHT_LEVELS)[:, 0]
        padded = torch.cat([weight, weight.new_zeros(weight.shape[0], ENDS.shape[1])], 1)
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; fbgemm's prepack still takes them
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(padded, scale.double(), torch.zeros(len(scale), dtype=torch.long),
                                                   0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        # the bias is added after the row's magnitude is multiplied back, not by fbgemm
        return cls(torch.ops.quantized.linear_prepack(quantized, None), linear.in_features, linear.out_features, bias,
                   outliers, outlier_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if self.outliers is not None:
            # [rows, outliers, out] summed over the outliers one after another, each row alone
            extra = (flat.index_select(1, self.outliers)[:, :, None] * self.outlier_weight).sum(1)
            flat = flat.index_fill(1, self.outliers, 0.0)
        magnitude = torch.linalg.vector_norm(flat, float("inf"), -1, keepdim=True).clamp_min_(TINY)
        pinned = torch.cat([flat / magnitude, ENDS.expand(flat.shape[0], -1)], 1)
        out = torch.ops.quantized.linear_dynamic(pinned, self.packed, False).mul_(magnitude)
        if self.outliers is not None:
            out.add_(extra)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        outliers = 0 if self.outliers is None else len(self.outliers)
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"outliers={outliers}"


OUTLIERS = 4  # input channels per layer kept in float32 (SmolLM2, 512 tokens: 0, 2, 4, 8 -> x1.070, 1.016, 1.011, 1.014)
CALIBRATION = (  # Lewis Carroll, Alice's Adventures in Wonderland (1865), chapter 1: public domain
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
    "once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations "
    "in it, 'and what is the use of a book,' thought Alice 'without pictures or conversations?' So she was "
    "considering in her own mind (as well as she could, for the hot day made her feel very sleepy and stupid), "
    "whether the pleasure of making a daisy-chain would be worth the trouble of getting up and picking the "
    "daisies, when suddenly a White Rabbit with pink eyes ran close by her.")


@torch.no_grad()
def calibrate(model: nn.Module, ids: torch.Tensor, count: int = OUTLIERS) -> dict[nn.Linear, torch.Tensor]:
    """The `count` input channels of every nn.Linear of `model` with the largest magnitude
    over one forward of `ids` [1, tokens] (sorted channel ids, int64)."""
    peaks, hooks = {}, []
    for module in model.modules():
        if type(module) is nn.Linear:
            def record(layer, inputs, output):
                peak = inputs[0].detach().reshape(-1, layer.in_features).abs().amax(0)
                peaks[layer] = torch.maximum(peaks[layer], peak) if layer in peaks else peak
            hooks.append(module.register_forward_hook(record))
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return {layer: peak.topk(min(count, len(peak))).indices.sort().values for layer, peak in peaks.items()}


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] float (in a multiple of GROUP) -> (codes int32 [out, in] in 0..15,
    step [out, in / GROUP], minimum [out, in / GROUP]): w ≈ minimum + step * code, each group
    of GROUP inputs from its own minimum to its own maximum in 15 steps, as llama.cpp's Q4_1.
    A group that was Q4_1 already (its values minimum + step * code) comes back exactly, to
    float32 rounding."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    step = (high - low) / 15
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((groups - low[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.int32)
    return codes.reshape(out_features, in_features), step, low


class Int4Linear(nn.Module):
    """y = x W^T + b with W in 4 bits a weight, groups of GROUP inputs with a step and a
    minimum each (module docstring), by torch's CPU int4 kernel. `packed`: the kernel's layout
    of the codes; `scales_and_zeros` float32 [in / GROUP, out, 2]."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias)

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        """Whether the kernel takes the layer's shape (whole groups; outputs by 16)."""
        return linear.in_features % GROUP == 0 and linear.out_features % 16 == 0

    @classmethod
    def from_linear(cls, linear: nn.Linear, outliers=None) -> "Int4Linear":
        codes, step, low = quantize_int4(linear.weight)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        # the kernel computes (code - 8) * scale + zero
        scales_and_zeros = torch.stack([step.t(), (low + 8 * step).t()], -1).contiguous()
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(packed, scales_and_zeros, bias, linear.in_features, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, group={GROUP}"


class BFloat16Linear(nn.Module):
    """y = x W^T + b computed in bfloat16 (weights stored so), returned in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, outliers=None) -> "BFloat16Linear":
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()
        return cls(linear.weight.detach().to(torch.bfloat16).clone(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)


class Int8Embedding(nn.Module):
    """nn.Embedding with each token's row as int8 and one float32 scale (symmetric): a lookup
    reads 1 byte a value instead of 4 (SmolLM2's table: 113 MB -> 28 MB)."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, padding_idx: int | None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = values.shape
        self.padding_idx = padding_idx
        self.register_buffer("values", values)
        self.register_buffer("scale", scale)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> "Int8Embedding":
        weight = embedding.weight.detach().float()
        scale = row_scales(weight, 127)
        return cls(torch.round(weight / scale).to(torch.int8), scale, embedding.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.values[ids].float().mul_(self.scale[ids])

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


LAYERS = {"int8": Int8Linear, "int8-weight-only": WeightOnlyInt8Linear, "int4": Int4Linear, "bfloat16": BFloat16Linear}
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # layers a decoder feeds one input


class Fused(nn.Module):
    """Sibling layers that read the same input (a layer's q, k and v; gate and up) as one
    layer of their stacked outputs: one product, one input quantization, where there were
    two or three. Each sibling becomes a `Part` that takes its columns. The first part asked
    for an input computes all of them; the others take theirs from it, each once (a part asked
    again, or for another tensor, computes anew). The input is known by identity: a decoder
    hands its siblings one tensor and does not write it between their calls."""

    def __init__(self, layer: nn.Module, sizes: list[int]):
        super().__init__()
        self.layer, self.sizes = layer, sizes
        self._input, self._outputs, self._taken = None, None, set()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._input or index in self._taken:
            self._input, self._outputs, self._taken = x, self.layer(x).split(self.sizes, -1), set()
        self._taken.add(index)
        out = self._outputs[index]
        if len(self._taken) == len(self.sizes):
            self._input, self._outputs = None, None
        return out


class Part(nn.Module):
    """One sibling of a `Fused` layer: its columns of the fused output."""

    def __init__(self, fused: Fused, index: int, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features, self.index = in_features, out_features, index
        self.__dict__["fused"] = fused  # the parent holds it as a module; a second registration would count it twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.output(x, self.index)


def fuse(layer_type, linears: list[nn.Linear], outliers: torch.Tensor | None = None) -> Fused:
    """`linears` (one input width, one input) as one layer of `layer_type` over their stacked
    weights (`outliers`: Int8Linear's float channels)."""
    stacked = nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                        bias=any(m.bias is not None for m in linears))
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([m.weight for m in linears]))
        if stacked.bias is not None:
            stacked.bias.copy_(torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                                          for m in linears]))
    return Fused(layer_type.from_linear(stacked, outliers), [m.out_features for m in linears])


def use_weights(model: nn.Module, weights: str, calibration: torch.Tensor | None = None) -> int:
    """Replace every nn.Linear of `model` (a CPU float model) by the layer type of `weights`
    ("int8", "int4", "bfloat16"; "float32" changes nothing), in place; for int4, the format
    for least memory, the token embedding too (Int8Embedding: on SmolLM2 it cost 1.5% of
    perplexity, so int8 keeps its float32 one; a lookup reads one row, the same time). The logits layer of an
    int4 model is int8: llama.cpp's 4-bit files keep it (and the embedding it is often tied
    to) at 6-8 bits, a 4-bit one costs more than all the others; so is a layer whose shape the
    int4 kernel does not take (Int4Linear.fits). `calibration` [1, tokens]: the ids whose
    forward finds each int8 layer's outlier channels (`calibrate`; None: none kept apart).
    Returns how many changed."""
    if weights == "float32":
        return 0
    layer_type = LAYERS[weights]
    outliers = calibrate(model, calibration) if calibration is not None and weights in ("int8", "int4") else {}
    output = model.get_output_embeddings()
    changed = 0
    for parent in list(model.modules()):
        linears = {name: child for name, child in parent.named_children() if type(child) is nn.Linear}
        for names in SIBLINGS if layer_type is not WeightOnlyInt8Linear else ():  # a compiled round reads each layer's own
            group = [linears[name] for name in names if name in linears]
            if len(group) == len(names) and len({m.in_features for m in group}) == 1 and \
                    (layer_type is not Int4Linear or all(map(Int4Linear.fits, group))):
                parent.fused = fuse(layer_type, group, outliers.get(group[0]))  # "fused": its parts' shared layer, once in the module tree
                for index, name in enumerate(names):
                    setattr(parent, name, Part(parent.fused, index, group[index].in_features, group[index].out_features))
                    del linears[name]
                changed += len(names)
        for name, module in linears.items():
            kind = Int8Linear if layer_type is Int4Linear and (module is output or not Int4Linear.fits(module)) \
                else layer_type
            setattr(parent, name, kind.from_linear(module, outliers.get(module)))
            changed += 1
    if weights == "int4" and type(model.get_input_embeddings()) is nn.Embedding:  # int8's costs 1.5% of perplexity
        model.set_input_embeddings(Int8Embedding.from_embedding(model.get_input_embeddings()))
    # what is left (norms, an embedding of another kind) may lie in the checkpoint's mapped file, which keeps the
    # whole mapping alive and the float weights' pages resident: copied, the file is let go
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    gc.collect()
    return changed


def layer_bytes(module: nn.Module) -> int:
    """Bytes a linear layer's weights take in memory (0 for any other module)."""
    if isinstance(module, nn.Linear):
        return module.weight.numel() * module.weight.element_size()
    if isinstance(module, Int8Linear):
        apart = 0 if module.outliers is None else module.outlier_weight.numel() * 4
        return (module.in_features + ENDS.shape[1] + 4) * module.out_features + apart  # int8 values, a scale a row
    if isinstance(module, Int4Linear):
        return module.packed.numel() + module.scales_and_zeros.numel() * 4
    if isinstance(module, BFloat16Linear):
        return module.weight.numel() * 2
    if isinstance(module, WeightOnlyInt8Linear):
        return module.values.numel() + module.scale.numel() * 4
    return 0


def bfloat16_rows_alone(model: nn.Module) -> bool:
    """Whether each of `model`'s BFloat16Linear layer shapes gives every row the same bits alone
    as among 8, 32 or 64 rows, on this host. torch's bfloat16 product goes to oneDNN, which on
    CPUs with AMX picks its kernel by row count and shape (an AVX2 CPU has one). A different
    kernel adds in another order, which the bfloat16 output hides but for rare ties, so the
    probe makes order show: weights of ones, each row two entries of ±2^20 among values in
    [0, 1) that the big ones absorb or not depending on when they are added. ~0.3 s (SmolLM2)."""
    generator = torch.Generator().manual_seed(0)
    for inputs, outputs in {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, BFloat16Linear)}:
        layer = BFloat16Linear(torch.ones(outputs, inputs, dtype=torch.bfloat16), None)
        x = torch.rand(64, inputs, generator=generator)
        for row in x:
            big = torch.randperm(inputs, generator=generator)[:2]
            row[big] = torch.tensor([2.0 ** 20, -2.0 ** 20])
        with torch.no_grad():
            alone = torch.cat([layer(x[k:k + 1]) for k in range(64)])
            if any(not torch.equal(layer(x[:rows]), alone[:rows]) for rows in (8, 32, 64)):
                return False
    return True


def weights_note(weights: str, model: nn.Module | None = None) -> str:
    """What the loader's line adds about `weights` on this host (of `model`, loaded with them)."""
    if weights == "int8":
        return "" if WEIGHT_LEVELS == 127 else "; weights in 7 bits (no VNNI here: 8 would overflow fbgemm's sums)"
    if weights == "int4":
        return "; the logits layer int8"
    if weights == "int8-weight-only":
        return "; float32 inputs, each product a kernel inductor compiles on first use (seconds)"
    if weights == "bfloat16" and model is not None and not bfloat16_rows_alone(model):
        return ("; this CPU's bfloat16 kernels round a row differently among other rows (AMX: oneDNN picks "
                "its kernel by row count), so batched and chunked forwards are close to, not the bits of, "
                "one row at a time (docs/weights.md)")
    return ""


def quantized_gguf(name: str) -> bool:
    """Whether `name` is a GGUF file whose linear weights are quantized (not F32/F16/BF16)."""
    if not name.lower().endswith(".gguf"):
        return False
    from pathlib import Path

    from .checks import ModelError
    from .gguf import read_header
    from gguf import GGMLQuantizationType as Q
    path = Path(name).expanduser().resolve()
    if not path.is_file():  # missing, or a pipe whose read would block: the load refuses it
        return False
    try:
        header = read_header(path)
    except (ModelError, OSError):
        return False  # the load that follows refuses the file, naming what is wrong with it
    floats = {Q.F32, Q.F16, Q.BF16}
    return any(tensor.ggml_type not in floats for tensor in header.tensors.values() if len(tensor.shape) == 2)
