"""Training labels for the SmartKV gates: how long each token stays useful in each layer.

Lifespan (the definition the gates learn; docs/smartkv.md):
    In layer l, token j is *used* by a later query i when the largest attention any of the
    layer's query heads pays to it exceeds `threshold` times the uniform share, i.e.
        max_h A_h[i, j] > threshold / (i + 1)          (i + 1 = rows visible to query i).
    Its lifespan is the number of queries i in (j, j + horizon] that use it, and the label is
    log4(1 + lifespan) (0 for a token nobody uses again, log4(1 + horizon) for one used at every
    step). Max over heads because the cache keeps or drops a row for all of the layer's heads
    at once: a row one head still needs is needed.
    Per kv head (`groups` = kv heads): the max runs over the query heads that share one kv
    head, and each kv head gets its own lifespan, for a cache that keeps rows per kv head.

Where the numbers come from: one prefill per window of text. The attention tap
(models/attention.py) hands over each layer's query and keys exactly as the model attends with
them (after whatever projections, biases and q/k norms its family has, and RoPE); the layer's
attention matrix softmax(q·kᵀ·scaling) under the causal mask is formed there and reduced at
once (a window never holds more than one layer's [heads, L, L] matrix). The keys are stored
un-rotated (`KeyUnrotator`: all kv heads concatenated, [kv_heads * head_dim]), which is what
the cache un-rotates and scores — for a Llama, k_proj's output.

Windows: BOS + `window - 1` text tokens. Only tokens with a whole horizon after them inside
the window are labelled (positions 1 .. window - 1 - horizon), so no label is cut short by the
window's end; the next window starts where the labelled span ended. BOS itself is never a
label: it is an attention sink, which the cache keeps unconditionally.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..kv import rope
from ..models import attention


@dataclass(frozen=True)
class LifespanRule:
    """What counts as a token still being used (see the module docstring)."""

    horizon: int = 512        # later steps looked at; labels lie in [0, log4(1 + horizon)]
    threshold: float = 2.0    # multiple of the uniform share 1 / (rows visible)
    window: int = 1024        # tokens per prefill (BOS included): bounds the attention matrices

    def __post_init__(self):
        if self.horizon < 1 or self.threshold <= 0:
            raise ValueError(f"horizon must be >= 1 and threshold > 0, got {self.horizon}, {self.threshold}")
        if self.window < self.horizon + 2:
            raise ValueError(f"window {self.window} leaves no token with a whole horizon of {self.horizon} after it")

    @property
    def labelled_per_window(self) -> int:
        """Positions 1 .. window - 1 - horizon of each window get a label."""
        return self.window - 1 - self.horizon

    def to_dict(self) -> dict:
        return asdict(self)


def log4(values: torch.Tensor) -> torch.Tensor:
    return torch.log(values.to(torch.float32)) / math.log(4.0)


def lifespans(attention: torch.Tensor, rule: LifespanRule, first: int, count: int, groups: int = 1) -> torch.Tensor:
    """Lifespan of keys first .. first + count from one layer's attention.

    attention: [heads, L, L] (query, key), causal, rows summing to 1. groups: 1 (the layer)
    or the kv heads (heads in consecutive groups of heads // groups share a kv head, as
    transformers' repeat_kv lays them out).
    Returns int64 [groups, count]: for each key j, how many queries i in (j, j + horizon]
    give it more than threshold / (i + 1) in at least one head of the group.
    """
    heads, length = attention.shape[0], attention.shape[-1]
    if groups < 1 or heads % groups:
        raise ValueError(f"{heads} query heads do not split into {groups} kv-head groups")
    strongest = attention.view(groups, heads // groups, length, length).amax(dim=1)  # [groups, L, L]
    visible = torch.arange(1, length + 1, dtype=strongest.dtype, device=strongest.device)
    used = strongest > (rule.threshold / visible)[:, None]             # [groups, query, key]
    keys = torch.arange(first, first + count, device=strongest.device)
    queries = torch.arange(length, device=strongest.device)[:, None]
    in_horizon = (queries > keys[None, :]) & (queries <= keys[None, :] + rule.horizon)
    return (used[:, :, first:first + count] & in_horizon).sum(dim=1)


@dataclass
class LabelSet:
    """Per layer: pre-RoPE keys [n, kv_heads * head_dim] (float32) and labels log4(1 + lifespan)
    [n, heads] (heads 1: the layer's lifespan; kv_heads: one per kv head)."""

    keys: list[torch.Tensor]
    labels: list[torch.Tensor]
    rule: LifespanRule
    texts: list[str] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def count(self) -> int:
        return 0 if not self.keys else int(self.keys[0].shape[0])

    @property
    def heads(self) -> int:
        """Lifespans per token and layer: 1 (per layer) or the kv heads."""
        return int(self.labels[0].shape[1])

    @staticmethod
    def concat(parts: list["LabelSet"]) -> "LabelSet":
        if not parts:
            raise ValueError("no label sets to join")
        layers = parts[0].num_layers
        return LabelSet(keys=[torch.cat([p.keys[l] for p in parts]) for l in range(layers)],
                        labels=[torch.cat([p.labels[l] for p in parts]) for l in range(layers)],
                        rule=parts[0].rule, texts=[t for p in parts for t in p.texts])

    def save(self, path) -> None:
        """Write as safetensors (keys in float16 to halve the file; labels float32)."""
        import json

        from safetensors.torch import save_file

        tensors = {}
        for l in range(self.num_layers):
            tensors[f"keys.{l}"] = self.keys[l].to(torch.float16).contiguous()
            tensors[f"labels.{l}"] = self.labels[l].to(torch.float32).contiguous()
        meta = {"smartkv_labels": json.dumps({"rule": self.rule.to_dict(), "texts": self.texts,
                                              "num_layers": self.num_layers})}
        save_file(tensors, str(path), metadata=meta)

    @staticmethod
    def load(path) -> "LabelSet":
        import json

        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["smartkv_labels"])
            layers = meta["num_layers"]
            keys = [f.get_tensor(f"keys.{l}").to(torch.float32) for l in range(layers)]
            labels = [f.get_tensor(f"labels.{l}") for l in range(layers)]
        labels = [y[:, None] if y.dim() == 1 else y for y in labels]  # per-layer files written before heads
        return LabelSet(keys=keys, labels=labels, rule=LifespanRule(**meta["rule"]), texts=meta["texts"])


class KeyUnrotator:
    """Undo RoPE on stored keys: [1, kv_heads, q, head_dim] at positions [q] -> [q, kv_heads * head_dim]
    float32, the key before RoPE (a Llama's k_proj output): what the gates are trained on and score."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)

    @staticmethod
    def for_config(config) -> "KeyUnrotator":
        """From a model config: the inverse frequencies its rotary embedding uses (pure rotations only)."""
        return KeyUnrotator(rope.inv_freq_for_config(config))

    def __call__(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rope.rotation(self.inv_freq, positions.cpu(), torch.zeros_like(positions.cpu()))
        plain = rope.rotate(keys.to(torch.float32), cos.to(keys.device), sin.to(keys.device))
        return plain[0].transpose(0, 1).reshape(keys.shape[2], -1)


class LabelRecorder:
    """Taps every attention layer: while active, each forward of one window (no cache) leaves,
    per layer, the labelled keys' pre-RoPE vectors and lifespans of the current window."""

    def __init__(self, model, rule: LifespanRule, groups: int = 1, unrotate: KeyUnrotator | None = None):
        self.num_layers = model.config.num_hidden_layers
        self.rule, self.groups = rule, groups
        self.unrotate = unrotate or KeyUnrotator.for_config(model.config)
        self.first = self.count = 0
        self.keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.spans: list[torch.Tensor | None] = [None] * self.num_layers
        self._tap = None

    def __enter__(self):
        self._tap = attention.tap(self._see)
        self._tap.__enter__()
        return self

    def __exit__(self, *exc):
        self._tap.__exit__(*exc)
        self._tap = None

    @torch.no_grad()
    def _see(self, module, query, key, value, scaling) -> None:
        """query [1, heads, L, d], key [1, kv_heads, L, d]: the window's own rows, rotated at 0 .. L-1."""
        index, length = module.layer_idx, key.shape[2]
        positions = torch.arange(self.first, self.first + self.count)
        self.keys[index] = self.unrotate(key[:, :, self.first:self.first + self.count], positions).clone()
        heads, kv_heads = query.shape[1], key.shape[1]
        q = query[0].to(torch.float32).view(kv_heads, heads // kv_heads, length, -1)  # repeat_kv's grouping
        logits = (q @ key[0].to(torch.float32).transpose(-1, -2)[:, None]) * scaling  # [kv, group, L, L]
        causal = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
        weights = logits.masked_fill(causal, float("-inf")).softmax(dim=-1).view(heads, length, length)
        self.spans[index] = lifespans(weights, self.rule, self.first, self.count, self.groups).T  # [count, groups]


def windows(ids: list[int], rule: LifespanRule) -> list[tuple[int, list[int]]]:
    """(index of the window's first text token, the window's text tokens) for every window
    that has a full horizon after its labelled span. BOS is prepended by the caller."""
    step, span = rule.labelled_per_window, rule.window - 1
    return [(start, ids[start:start + span]) for start in range(0, len(ids) - span + 1, step)]


@torch.no_grad()
def label_text(lm, text: str, rule: LifespanRule, *, max_tokens: int | None = None, name: str = "",
               on_window=None, per_head: bool = False) -> LabelSet:
    """Labels of every token of `text` that a window covers with a whole horizon.

    lm: a positronic.models.LoadedModel. max_tokens: read only the first this many
    text tokens. on_window(): called after each window (progress). per_head: a lifespan per
    kv head, not per layer. Returns a LabelSet with one entry per labelled token, in text order.
    """
    ids = lm.encode(text)[: max_tokens or None]
    spans = windows(ids, rule)
    if not spans:
        raise ValueError(f"text {name or ''} has {len(ids)} tokens; a window needs {rule.window - 1}")
    model = lm.model
    keys: list[list[torch.Tensor]] = [[] for _ in range(lm.num_layers)]
    labels: list[list[torch.Tensor]] = [[] for _ in range(lm.num_layers)]
    with LabelRecorder(model, rule, lm.num_kv_heads if per_head else 1, KeyUnrotator(lm.inv_freq)) as recorder:
        recorder.first, recorder.count = 1, rule.labelled_per_window
        for _, chunk in spans:
            window = torch.tensor([[lm.bos_id] + chunk], device=lm.device)
            model.model(input_ids=window, use_cache=False)  # the base model: no logits needed
            for l in range(lm.num_layers):
                keys[l].append(recorder.keys[l])
                labels[l].append(log4(recorder.spans[l] + 1))
            if on_window is not None:
                on_window()
    return LabelSet(keys=[torch.cat(k) for k in keys], labels=[torch.cat(y) for y in labels], rule=rule,
                    texts=[name] if name else [])


def window_count(lm, text: str, rule: LifespanRule, max_tokens: int | None = None) -> int:
    """How many prefills `label_text` will run (for a progress bar)."""
    return len(windows(lm.encode(text)[: max_tokens or None], rule))
