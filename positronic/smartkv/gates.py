"""The SmartKV gates: one small MLP per layer from a token's key to its predicted lifespan.

    gates = GateSet.load("positronic/smartkv/gates_smollm2.safetensors")
    gates.check_model(config)                        # layers and key width match the model?
    score = gates.score(layer, keys)                 # keys [n, kv_heads * head_dim] → [n, heads]

Input: the token's key in that layer *before RoPE*, all kv heads concatenated
([kv_heads * head_dim], the layout of `k_proj`'s output): the cache keeps or drops a row for
all heads of a layer at once, and an un-rotated key says what the token is, not where it is.
The input is standardised with per-channel mean and scale measured on the training keys (a
few channels of Llama keys are ~10x the rest), then `depth` linear layers with GELU between
them (hidden width `hidden`) give `heads` numbers: the predicted log4(1 + lifespan), see
labels.py, of the token in the layer (heads 1, the shipped gates) or in each of the layer's
kv heads (heads = kv_heads: a SmartKVCache then keeps rows per kv head).

File format (safetensors only; no pickle): tensors `layers.{l}.mean`, `layers.{l}.scale`,
`layers.{l}.linear.{k}.weight|bias` (a shared set: layer 0 only), float16 (the scores only rank rows, so half precision
loses nothing that matters and halves the file), and one metadata entry `smartkv` holding a
JSON header: {"format": 1, "num_layers", "in_dim", "hidden", "depth", "heads" (absent: 1),
"shared", "model", "lifespan": {...}, "trained": {...}}. `load` checks the header and every tensor's shape and
refuses anything else with a `GateFileError` naming the problem.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

FORMAT_VERSION = 1
HEADER_KEY = "smartkv"
DEFAULT_HIDDEN = 256
DEFAULT_DEPTH = 3
SHIPPED = {"smollm2": Path(__file__).resolve().parent / "gates_smollm2.safetensors"}
# one gate for every layer (the ablation of bench/smartkv.py), not used by default
SHIPPED_SHARED = {"smollm2": Path(__file__).resolve().parent / "gates_smollm2_shared.safetensors"}


class GateFileError(ValueError):
    """A gate file cannot be used: not safetensors, a bad header, or tensors of the wrong shape."""


class Gate(nn.Module):
    """One layer's MLP: keys [n, in_dim] (pre-RoPE) → predicted log4(1 + lifespan) [n, heads]."""

    def __init__(self, in_dim: int, hidden: int = DEFAULT_HIDDEN, depth: int = DEFAULT_DEPTH, heads: int = 1):
        super().__init__()
        if min(in_dim, hidden, depth, heads) < 1:
            raise ValueError(f"in_dim, hidden, depth and heads must be >= 1, got {in_dim}, {hidden}, {depth}, {heads}")
        self.in_dim, self.hidden, self.depth, self.heads = in_dim, hidden, depth, heads
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("scale", torch.ones(in_dim))
        widths = [in_dim] + [hidden] * (depth - 1) + [heads]
        self.linear = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def set_normalisation(self, keys: torch.Tensor) -> None:
        """Standardise inputs like `keys` [n, in_dim]: per-channel mean and std (floored)."""
        self.mean.copy_(keys.mean(dim=0))
        self.scale.copy_(keys.std(dim=0).clamp_min(1e-3))

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        x = (keys.to(self.mean.dtype) - self.mean) / self.scale
        for i, layer in enumerate(self.linear):
            x = layer(x)
            if i < len(self.linear) - 1:
                x = nn.functional.gelu(x)
        return x

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass
class GateSet:
    """The gates of every layer of one model (a shared set repeats one Gate object).

    header: the JSON header written with the file (architecture, lifespan rule, training facts).
    """

    gates: list[Gate]
    header: dict = field(default_factory=dict)

    # --- construction ----------------------------------------------------------------------

    @staticmethod
    def new(num_layers: int, in_dim: int, *, hidden: int = DEFAULT_HIDDEN, depth: int = DEFAULT_DEPTH,
            heads: int = 1, shared: bool = False, seed: int = 0, header: dict | None = None) -> "GateSet":
        """Freshly initialised (untrained) gates, deterministic in `seed`."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            if shared:
                one = Gate(in_dim, hidden, depth, heads)
                gates = [one] * num_layers
            else:
                gates = [Gate(in_dim, hidden, depth, heads) for _ in range(num_layers)]
        finally:
            torch.random.set_rng_state(generator_state)
        head = {"format": FORMAT_VERSION, "num_layers": num_layers, "in_dim": in_dim, "hidden": hidden,
                "depth": depth, "heads": heads, "shared": shared}
        head.update(header or {})
        return GateSet([g.eval().requires_grad_(False) for g in gates], head)

    @staticmethod
    def for_config(config, *, per_head: bool = False, **kwargs) -> "GateSet":
        """Untrained gates shaped for a transformers Llama config (per_head: an output per kv head)."""
        layers, in_dim = key_shape(config)
        return GateSet.new(layers, in_dim, heads=kv_heads(config) if per_head else 1, **kwargs)

    # --- facts -----------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.gates)

    @property
    def in_dim(self) -> int:
        return self.gates[0].in_dim

    @property
    def heads(self) -> int:
        """Scores per token and layer: 1 (rows kept per layer) or the model's kv heads (per kv head)."""
        return self.gates[0].heads

    @property
    def shared(self) -> bool:
        return all(g is self.gates[0] for g in self.gates)

    @property
    def horizon(self) -> int:
        """Steps ahead the labels counted lifespan over (the file's lifespan rule; untrained
        gates: the default rule's)."""
        from .labels import LifespanRule

        horizon = self.header.get("lifespan", {}).get("horizon", LifespanRule.horizon)
        if type(horizon) is not int or horizon < 1:
            raise GateFileError(f"the gates' lifespan horizon must be a positive integer, got {horizon!r}")
        return horizon

    def check_model(self, config) -> None:
        """Raise GateFileError unless these gates fit the model: same layer count, key width, and
        one score per layer or one per kv head."""
        layers, in_dim = key_shape(config)
        if (layers, in_dim) != (self.num_layers, self.in_dim):
            raise GateFileError(f"the gates are for {self.num_layers} layers with keys of width {self.in_dim}; "
                                f"this model has {layers} layers with keys of width {in_dim}")
        if self.heads not in (1, kv_heads(config)):
            raise GateFileError(f"the gates score {self.heads} heads per layer; this model has {kv_heads(config)} "
                                "kv heads (gates score 1 per layer or 1 per kv head)")

    # --- scoring ---------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Predicted log4(1 + lifespan) of pre-RoPE keys [n, in_dim] in `layer`: float32 [n, heads],
        on the keys' device (the gate follows the keys there the first time)."""
        gate = self.gates[layer]
        if gate.mean.device != keys.device:
            for g in set(self.gates):
                g.to(keys.device)
        return gate(keys.to(torch.float32))

    # --- files -----------------------------------------------------------------------------

    def save(self, path) -> None:
        """Write the gates as safetensors (float16) with the JSON header as metadata."""
        from safetensors.torch import save_file

        tensors = {}
        for l, gate in enumerate(self.gates[:1] if self.shared else self.gates):  # a shared gate once
            for name, tensor in gate.state_dict().items():
                tensors[f"layers.{l}.{name}"] = tensor.detach().to("cpu", torch.float16).contiguous()
        header = dict(self.header, format=FORMAT_VERSION, num_layers=self.num_layers, in_dim=self.in_dim,
                      hidden=self.gates[0].hidden, depth=self.gates[0].depth, heads=self.heads, shared=self.shared)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={HEADER_KEY: json.dumps(header, sort_keys=True)})

    @staticmethod
    def load(path) -> "GateSet":
        """Read a gate file written by `save`; GateFileError on anything else."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise GateFileError(f"gate file {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise GateFileError(f"{path} is not a safetensors gate file ({_one_line(exc)}); "
                                "gates are stored only as safetensors") from None
        header = _parse_header(path, metadata)
        gates = _build(path, header, tensors)
        return GateSet(gates, header)

    @staticmethod
    def for_model(name: str) -> "GateSet":
        """The gates shipped in the repo for model `name` (only smollm2)."""
        if name not in SHIPPED:
            raise GateFileError(f"no gates are shipped for model {name!r} (only {', '.join(SHIPPED)}): "
                                "train some with `python -m positronic.smartkv train`")
        return GateSet.load(SHIPPED[name])

    def parameter_count(self) -> int:
        return sum(g.parameter_count() for g in set(self.gates))


def bench_gates(lm, folder) -> tuple[GateSet, str]:
    """The gates a benchmark runs `lm`'s smartkv with, and the `BrainConfig.gates` that picks
    them: the shipped ones and "", else untrained ones (they cost what trained ones do; none
    are shipped for random models) saved in `folder` and that file's path."""
    if lm.name in SHIPPED:
        return GateSet.load(SHIPPED[lm.name]), ""
    gates, path = GateSet.for_config(lm.model.config, seed=0), str(Path(folder) / "gates.safetensors")
    gates.save(path)
    return gates, path


def kv_heads(config) -> int:
    """The kv heads of a transformers model config."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def key_shape(config) -> tuple[int, int]:
    """(layers, kv_heads * head_dim) of a transformers model config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads(config) * head_dim


def _parse_header(path: Path, metadata: dict) -> dict:
    if HEADER_KEY not in metadata:
        raise GateFileError(f"{path} has no '{HEADER_KEY}' header: not a SmartKV gate file")
    try:
        header = json.loads(metadata[HEADER_KEY])
    except json.JSONDecodeError as exc:
        raise GateFileError(f"{path}: the '{HEADER_KEY}' header is not JSON ({exc.msg})") from None
    if not isinstance(header, dict):
        raise GateFileError(f"{path}: the '{HEADER_KEY}' header is not a JSON object")
    if header.get("format") != FORMAT_VERSION:
        raise GateFileError(f"{path}: gate file format {header.get('format')!r}; this code reads {FORMAT_VERSION}")
    header.setdefault("heads", 1)  # files written before per-head gates score per layer
    for key in ("num_layers", "in_dim", "hidden", "depth", "heads"):
        value = header.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GateFileError(f"{path}: header field {key!r} must be a positive integer, got {value!r}")
    return header


def _build(path: Path, header: dict, tensors: dict[str, torch.Tensor]) -> list[Gate]:
    """Gates from the tensors, every name and shape checked against the header."""
    layers, in_dim, hidden, depth, heads = (header[k] for k in ("num_layers", "in_dim", "hidden", "depth", "heads"))
    shared = header.get("shared", False)
    if not isinstance(shared, bool):
        raise GateFileError(f"{path}: header field 'shared' must be true or false, got {shared!r}")
    stored = 1 if shared else layers  # a shared set stores its one gate once, as layer 0
    template = Gate(in_dim, hidden, depth, heads)
    expected = {f"layers.{l}.{name}": tuple(t.shape)
                for l in range(stored) for name, t in template.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        what = (f"missing {missing[:3]}" if missing else "") + (" " if missing and extra else "") + \
               (f"unexpected {extra[:3]}" if extra else "")
        raise GateFileError(f"{path}: tensors do not match the header ({layers} layers, in {in_dim}, "
                            f"hidden {hidden}, depth {depth}, heads {heads}): {what}")
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise GateFileError(f"{path}: tensor {name} has shape {list(got)}, expected {list(shape)}")
        if not tensors[name].is_floating_point() or not torch.isfinite(tensors[name]).all():
            raise GateFileError(f"{path}: tensor {name} is not finite floating point")
    gates = []
    for l in range(stored):
        gate = Gate(in_dim, hidden, depth, heads)
        gate.load_state_dict({name: tensors[f"layers.{l}.{name}"].to(torch.float32) for name in template.state_dict()})
        gates.append(gate.eval().requires_grad_(False))
    return gates * layers if shared else gates  # shared: one object in every layer, as trained


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200] or type(error).__name__


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two [n] tensors, ties given their average rank."""
    if a.numel() != b.numel() or a.numel() < 2:
        raise ValueError("spearman needs two tensors of the same length >= 2")
    ra, rb = _ranks(a.double()), _ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    return float((ra * rb).sum()) / denominator if denominator > 0 else float("nan")


def _ranks(x: torch.Tensor) -> torch.Tensor:
    values, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average = ends - (counts.double() - 1) / 2  # 1-based average rank of each distinct value
    return average[inverse]
