"""Core v4's decode round as one compiled graph (`Engine(..., compiled=True)`, `--compile`).

A round's forward (positronic/state/slots.py) feeds one new token for each active slot over
the slot buffers. Eager, each layer of it is some forty operations dispatched from Python; here
the whole round, from the embedding to the logits, the newest query and log-normaliser of
every layer and the attention shares the presses score, is one function of tensors that
`torch.compile` turns into one graph (inductor: fused C++ loops on a CPU, Triton kernels on a
GPU). The model's own modules' weights and arithmetic; the attention written out as
`decode_attention` writes it (for int8-weight-only on a CPU as `traced_decode_attention`: its
products inductor's loops, not two external calls a layer; `ROUND_WEIGHTS`).

Shapes never change, so nothing recompiles. The active slots are padded to a bucket (2, 4, 8,
... up to the buffers' slots, as vLLM pads its CUDA graphs): padding slots feed token 0 at
position 0 into row 0 of slots no sequence holds (a joining sequence writes its rows over
them). The K/V buffers are the same tensors every round, written in place with one
`index_put_` per layer (a buffer handed to the graph and written through a view is copied
whole by the compiler; an `index_put_` on the buffer itself is not). Edits, joins and leaves
change the buffers' contents, never a shape: one compile per bucket for a run of any length
(`compiles` counts them; tests/positronic/models/test_compiled.py holds it over rounds with
evictions, joins and leaves).

Numbers. Inductor fuses and reorders, so a compiled round's logits differ from the eager
round's in their last bits (~1e-4 on SmolLM2): its tokens can part from the eager ones at a
near-tie. What it keeps is batched = alone. In float32 on a CPU every product is oneDNN's, as
the eager layers' (`linear.row_linear`, an op the compiler keeps whole, with the weight packed
once), whose rows are computed alone for two rows or more, and every other operation works
slot by slot; such a bucket is never 1 (a lone sequence is padded to 2). Left to itself inductor
lowers a float32 linear to MKL's packed product, whose rows kept their bits across buckets on
an AMX Xeon and did not on an AMD EPYC (both ran this suite): the op is what makes the claim
hold on any CPU, and on the EPYC it is faster too (SmolLM2, a round of 2: 49.6 against 70.5
ms). In bfloat16 on a CPU the products are inductor's own GEMM templates (`inductor_settings`),
whose row independence is measured (the same bits in buckets 2, 4 and 8 on SmolLM2 and
random:tiny on the Xeon; tested on random:tiny, passing on both CPUs), not argued. On a GPU
every product and norm runs over fixed 64-row tiles (models/tiles.py), as the eager layers
there do; whether that makes batched = alone hold is measured (bench/gpu.sh), not claimed:
on 2026-12-04, before the tiles, it did not (bench/results/gpu.md).

With `--weights int8-weight-only` (models/weight_only.py) each product is the eager layer's own
`weight_only_product`, traced into the round: inductor writes it as one loop a row that reads the
int8 weights and widens them in registers (not frozen: freezing would fold the weights into float32
copies), its additions in the same order for one row or many, so a lone sequence's round is one
slot and batched = alone holds from bucket 1 (tested). (The eager layer's tiles for several rows,
models/weight_only.py, measured slower as an op the graph calls: the loop stays.) SmolLM2 past
its budget: a round of one ~11 ms on a 2-core AVX-512 CPU, float32's ~50 (bench/results/weights.md).

It runs the models built of transformers' Llama classes (`LeanLlama.fits`: Llama, SmolLM2,
TinyLlama; Mistral, Qwen and Phi-3 have classes of their own) with float weights (`nn.Linear`,
`RowInvariantLinear`) or int8-weight-only ones; `refusal` names what it cannot run (fbgemm's int8
or int4 layers, another family), and the engine says so before it starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
import time
import warnings
from typing import Callable, Hashable

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama import modeling_llama as llama

from .attention import Decode, decode_mask, decode_weights, traced_decode_attention
from .dynamo import lift_limits
from .lean import LeanLlama
from .linear import ONEDNN, row_linear
from .tiles import by_tiles
from .weight_only import WeightOnlyInt8Linear

log = logging.getLogger(__name__)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RoundWeights:
    """What a round's graph does differently for one --weights format it computes."""
    smallest: int  # the slots a lone sequence's round runs in (its smallest bucket)
    freezing: bool  # inductor's freezing
    loops: bool  # on a CPU, the attention's products as inductor's loops (`traced_decode_attention`)


ROUND_WEIGHTS = {
    # oneDNN's packed products (freezing packs them once) compute a row alone for two rows or more;
    # the attention as loops measured slower here (SmolLM2, 2 threads: 20.2 tok/s against 22.1)
    "float32": RoundWeights(smallest=2, freezing=True, loops=False),
    # weight_only_product sums a row in one order at any row count; freezing would fold its
    # `values.to(float32)` into float32 copies of the weights (4x the bytes a round reads, and the
    # memory); the attention as loops: 93.7 tok/s against 84.7
    "int8-weight-only": RoundWeights(smallest=1, freezing=False, loops=True),
}


# each decoder layer's products the graph computes (`linear` in `_Graph._round`), as (module, its layer)
PRODUCTS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
            ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def refusal(lm) -> str | None:
    """Why a compiled round cannot run `lm`, or None if it can: the model must be Llama's
    classes (`LeanLlama.fits`), and every product the graph computes an `nn.Linear` of float
    weights, the embedding an `nn.Embedding` (another weight format replaces them by layers of
    its own: models/weights.py)."""
    model = lm.model
    if not LeanLlama.fits(model, tiled=True):
        return f"a compiled round runs Llama-class models; {type(model).__name__} is not one"
    weights = lm.weights
    if weights not in ROUND_WEIGHTS:  # models/weights.py replaced the linear layers
        return (f"a compiled round runs float weights or --weights int8-weight-only, not --weights {weights} "
                "(for half precision: --dtype bfloat16)")
    core = model.model
    if type(core.embed_tokens) is not nn.Embedding:
        return f"a compiled round runs float weights (--weights float32); the embedding is {type(core.embed_tokens).__name__}"
    products = [(f"model.layers.{index}.{part}.{name}", getattr(getattr(layer, part), name))
                for index, layer in enumerate(core.layers) for part, name in PRODUCTS]
    for name, module in [*products, ("lm_head", model.lm_head)]:
        if isinstance(module, WeightOnlyInt8Linear):  # the round traces its product (`linear` in `_round`)
            continue
        if not isinstance(module, nn.Linear):  # a TiledLinear is one (models/tiles.py)
            return f"a compiled round runs float weights (--weights float32); {name} is {type(module).__name__}"
        if module.weight.dtype not in FLOATS:
            return f"a compiled round runs float weights; {name} is {module.weight.dtype}"
    return None


def smallest_bucket(lm) -> int:
    """The slots a lone sequence's round of `lm` runs in (`ROUND_WEIGHTS`; a format no round runs
    is refused by `refusal` when the round is made)."""
    return ROUND_WEIGHTS.get(lm.weights, ROUND_WEIGHTS["float32"]).smallest


def buckets(slots: int, smallest: int = 2) -> list[int]:
    """The padded sizes a round of `slots` buffers runs at: `smallest` (1 or 2), then 2, 4,
    8, ... and `slots`."""
    sizes, size = [smallest], 2
    while size < slots:
        sizes.append(size)
        size *= 2
    return sorted({*sizes, max(slots, smallest)})


class CompiledRound:
    """`round(tokens, rows, positions)` -> the eager round's results (`SlotState._forward`):
    logits [active, vocab] float32, shares [active, recorded layers, heads, capacity] float32
    and their mean over layers and heads [active, capacity],
    queries (scaled) [active, layers, heads, head_dim] and log-normalisers [active, layers,
    heads] float32. tokens, rows, positions: [active] int64, slot s's token written into its
    row `rows[s]` at RoPE position `positions[s]` (rows past `rows[s]` hidden).

    `keys`, `values`: the slot buffers `[layers, slots, kv_heads, capacity, head_dim]`, slots
    >= `smallest_bucket(lm)` (SlotState makes them so); `recorded`: the layers whose shares the presses read.
    Rounds of one model and recorded layers share their graphs (`_Graph`), whatever state
    or engine runs them: a second engine on the same model compiles nothing new."""

    def __init__(self, lm, keys: torch.Tensor, values: torch.Tensor, recorded: list[int]):
        if (why := refusal(lm)) is not None:
            raise ValueError(why)
        if keys.shape[1] < (smallest := smallest_bucket(lm)):
            raise ValueError(f"a compiled round of this model pads a lone sequence to {smallest} slots: "
                             f"give the buffers {smallest} or more")
        self.keys, self.values = keys, values
        graphs = lm.model.__dict__.setdefault("_positronic_graphs", {})  # {(recorded, device): _Graph}
        self.graph = graphs.get(key := (tuple(recorded), keys.device.type))
        if self.graph is None:
            self.graph = graphs[key] = _Graph(lm, list(recorded), keys.device.type)
        self.sizes = buckets(keys.shape[1], smallest)
        if keys.device.type == "cuda":  # captured graphs need the buffers at fixed addresses
            torch._dynamo.mark_static_address(keys)
            torch._dynamo.mark_static_address(values)

    @property
    def compiles(self) -> int:
        """Graphs made for this model and recorded layers so far (one per bucket used)."""
        return self.graph.compiles

    def bucket(self, active: int) -> int:
        return next(size for size in self.sizes if size >= active)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor):
        active = tokens.shape[0]
        pad = self.bucket(active) - active
        if pad:
            zeros = tokens.new_zeros(pad)
            tokens, rows, positions = (torch.cat([t, zeros]) for t in (tokens, rows, positions))
        # under a dispatch mode (an op counter, a flop counter) dynamo compiles nothing, and a
        # frame it gave up on stays given up: such a round runs the same function eagerly
        eager = torch._C._len_torch_dispatch_stack() or self.graph.broken is not None
        run = self.graph.eager if eager else self.graph.run
        lift_limits()
        try:
            # freezing: set where dynamo hands the graph over (given to compile_fx as a patch it
            # was not applied: the products' bits then moved with the bucket; tested)
            with torch._inductor.config.patch(self.graph.inductor):
                if self.keys.is_cuda and not eager:  # each round a new step of the captured graphs: the
                    torch.compiler.cudagraph_mark_step_begin()  # last round's outputs were copied out
                logits, shares, mean, queries, norms = run(tokens, rows, positions, self.keys, self.values)
        except Exception as exc:  # the round fails (and is rebuilt); the rounds after it run eagerly
            if not eager:
                self.graph.broken = f"{type(exc).__name__}: {exc}"
                log.warning("the compiled round failed (%s); rounds run eagerly from now on", self.graph.broken)
            raise
        return logits[:active], shares[:active], mean[:active], queries[:active], norms[:active]


class Functions:
    """Small functions of tensors around the round (a plain round's prelude and its writes),
    each compiled once per key and shape with inductor's defaults: a few fused kernels and one
    Python call instead of dozens of operations (a kernel launch each on a GPU). `compiles`
    counts the graphs made. Under a dispatch mode (an op counter) they run eagerly, as the
    round does, and for good once a compile has failed (`broken` says why)."""

    def __init__(self, what: str):
        self.what = what
        self._compiled: dict[Hashable, Callable] = {}
        self.compiles = 0
        self.broken: str | None = None

    def __call__(self, key: Hashable, function: Callable, *tensors):
        """`function(*tensors)`, compiled the first time `key` comes (later calls of the same key
        run that first function's graph: a key names all that `function` holds)."""
        if torch._C._len_torch_dispatch_stack() or self.broken is not None:
            return function(*tensors)
        run = self._compiled.get(key)
        if run is None:
            def run(*tensors, function=function):
                return function(*tensors)
            run = self._compiled[key] = torch.compile(run, fullgraph=True, dynamic=False, backend=self._backend)
        lift_limits()
        try:
            return run(*tensors)
        except Exception as exc:  # a compile that failed ran nothing: this call and the later ones run eagerly
            self.broken = f"{type(exc).__name__}: {exc}"
            log.warning("compiling %s failed (%s); it runs eagerly from now on", self.what, self.broken)
            return function(*tensors)

    def _backend(self, graph, inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        clock = time.perf_counter()
        compiled = compile_fx(graph, inputs)
        log.info("compiled %s in %.1f s", self.what, time.perf_counter() - clock)
        return compiled


def inductor_settings(dtype: torch.dtype, device: str, weights: str = "float32") -> dict:
    """Inductor's settings for a round's graph. Freezing as `ROUND_WEIGHTS` says (for float
    weights: oneDNN's packed linears on a CPU, a row's numbers whatever rows are beside it).
    On a CPU in bfloat16, inductor's own
    GEMM templates too, each product's kernel picked by timing it once (AMX micro-kernels for one
    to a few rows, where oneDNN's linear is slow), with q/k/v and gate/up each one product:
    SmolLM2 in bfloat16, a round of one 15.8 ms against 23.2 (float32: 28.7 against 29.9, a
    product there is memory-bound, so float32 keeps oneDNN and the shorter compile)."""
    settings = {"freezing": ROUND_WEIGHTS[weights].freezing}
    if device == "cpu" and dtype == torch.bfloat16:  # float16 not measured: oneDNN's linears as before
        settings |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                     "cpp.enable_concat_linear": True,
                     # its timings are the compile's business, not lines on a run's stderr
                     "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    return settings


class _Graph:
    """One model's compiled round for one set of recorded layers: `run(tokens, rows, positions,
    keys, values)`, traced and compiled once per shape (bucket)."""

    def __init__(self, lm, recorded: list[int], device: str):
        self.lm, self.recorded, self.device = lm, recorded, device
        self.compiles = 0
        self.inductor = inductor_settings(lm.dtype, device, lm.weights)
        self.onednn = device == "cpu" and lm.dtype == torch.float32 and ONEDNN
        self.loops = device == "cpu" and ROUND_WEIGHTS[lm.weights].loops
        self.run = torch.compile(self._round, fullgraph=True, dynamic=False, backend=self._backend,
                                 options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.eager = self._round
        self.broken: str | None = None  # why compiled rounds stopped (they run eagerly then)

    def _backend(self, graph, inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        patches = {}
        if self.device == "cuda":
            patches["triton.cudagraphs"] = True  # torch.compile's "reduce-overhead"
        size, clock = next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() == 1), "?"), time.perf_counter()
        log.info("compiling the decode round for %s sequences (once for this size)", size)
        with warnings.catch_warnings():  # inductor's autotuner reads a TypedStorage (bfloat16): its business
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
            compiled = compile_fx(graph, inputs, config_patches=patches)
        log.info("compiled the decode round for %s sequences in %.1f s", size, time.perf_counter() - clock)
        return compiled

    def _round(self, tokens, rows, positions, keys, values):
        """Traced once per bucket: the whole round over `keys` / `values` (written in place)."""
        model, core = self.lm.model, self.lm.model.model
        size, capacity = tokens.shape[0], keys.shape[3]
        kv_heads = keys.shape[2]
        slots = torch.arange(size, device=tokens.device)
        mask = decode_mask(rows, capacity, keys.dtype)  # [size, 1, 1, capacity]
        heads_of = torch.arange(kv_heads, device=tokens.device)[None]
        where = (slots[:, None].expand(size, kv_heads), heads_of.expand(size, kv_heads), rows[:, None].expand(size, kv_heads))
        # on a GPU every row-wise layer runs over fixed 64-row tiles (models/tiles.py), so its kernel,
        # and a row's bits, are the same in every bucket; on a CPU freezing's packed products are
        rows = by_tiles if self.device == "cuda" else (lambda function, x: function(x))

        def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            if isinstance(module, WeightOnlyInt8Linear):  # its sum is the eager layer's kernel's (weights.py)
                return module.product(x)
            if self.onednn:  # float32 on a CPU: oneDNN's row-invariant product (models/linear.py)
                return row_linear(x, module.weight, module.bias)
            return rows(lambda x: F.linear(x, module.weight, module.bias), x)

        def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return rows(getattr(module, "untiled", module), x)

        hidden = core.embed_tokens(tokens[:, None])  # [size, 1, hidden]
        cos, sin = core.rotary_emb(hidden, positions[:, None])
        queries, norms, shares = [], [], []
        for index, layer in enumerate(core.layers[: model.config.num_hidden_layers]):
            attention = layer.self_attn
            residual = hidden
            hidden = norm(layer.input_layernorm, hidden)
            shape = (size, 1, -1, attention.head_dim)
            query = linear(attention.q_proj, hidden).view(shape).transpose(1, 2)  # [size, heads, 1, head_dim]
            key = linear(attention.k_proj, hidden).view(shape).transpose(1, 2)  # [size, kv_heads, 1, head_dim]
            value = linear(attention.v_proj, hidden).view(shape).transpose(1, 2)
            query, key = llama.apply_rotary_pos_emb(query, key, cos, sin)
            layer_index = torch.full_like(where[0], index)
            keys.index_put_((layer_index, *where), key[:, :, 0].to(keys.dtype))
            values.index_put_((layer_index, *where), value[:, :, 0].to(values.dtype))
            attended = Decode(keys[index, :size], values[index, :size], mask)
            if self.loops:  # inductor's own loops, fused with the softmax (attention.py)
                out, weights, log_norm = traced_decode_attention(query, attended, attention.scaling)
            else:
                weights, log_norm = decode_weights(query, attended, attention.scaling)  # [size, kv_heads, group, capacity]
                out = (weights.to(values.dtype) @ values[index, :size]).to(query.dtype)  # [size, kv_heads, group, head_dim]
            queries.append(query[:, :, 0].float() * attention.scaling)  # [size, heads, head_dim]
            norms.append(log_norm[:, :, 0])
            if index in self.recorded:  # the shares are the weights (a second product with the keys
                shares.append(weights.reshape(size, -1, capacity))  # would copy the whole buffer)
            out = out.reshape(size, 1, -1)
            hidden = residual + linear(attention.o_proj, out)
            residual = hidden
            mlp, normed = layer.mlp, norm(layer.post_attention_layernorm, hidden)
            hidden = residual + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, normed)) * linear(mlp.up_proj, normed))
        hidden = norm(core.norm, hidden)
        logits = linear(model.lm_head, hidden)[:, -1].float()
        shares = torch.stack(shares, dim=1)
        return logits, shares, shares.mean(dim=(1, 2)), torch.stack(queries, dim=1), torch.stack(norms, dim=1)

