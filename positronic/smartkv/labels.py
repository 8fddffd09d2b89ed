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

Where the numbers come from: one prefill per window of text with eager attention, the model's
own attention matrices read in a forward hook and reduced at once (a window never holds more
than one layer's [heads, L, L] matrix), and the keys taken before RoPE from `k_proj` (all kv
heads concatenated: [kv_heads * head_dim]), which is what the cache un-rotates and scores.

Windows: BOS + `window - 1` text tokens. Only tokens with a whole horizon after them inside
the window are labelled (positions 1 .. window - 1 - horizon), so no label is cut short by the
window's end; the next window starts where the labelled span ended. BOS itself is never a
label: it is an attention sink, which the cache keeps unconditionally.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch


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


class LabelRecorder:
    """Hooks on every attention module of a Llama: while active, each forward leaves, per
    layer, the labelled keys' pre-RoPE vectors and lifespans of the current window.

    The model must run eager attention (the hook reads the attention weights the module
    returns); `label_windows` switches it and back.
    """

    def __init__(self, model, rule: LifespanRule, groups: int = 1):
        self.layers = model.model.layers
        self.rule, self.groups = rule, groups
        self.first = self.count = 0
        self.keys: list[torch.Tensor | None] = [None] * len(self.layers)
        self.spans: list[torch.Tensor | None] = [None] * len(self.layers)
        self._handles = []

    def __enter__(self):
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            self._handles.append(attn.k_proj.register_forward_hook(self._keys_hook(index)))
            self._handles.append(attn.register_forward_hook(self._attention_hook(index)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keys_hook(self, index: int):
        def hook(module, inputs, output):  # output: [1, L, kv_heads * head_dim], before RoPE
            self.keys[index] = output[0, self.first:self.first + self.count].detach().to(torch.float32).clone()
        return hook

    def _attention_hook(self, index: int):
        def hook(module, inputs, output):  # output: (attn_output, attn_weights [1, heads, L, L])
            weights = output[1]
            if weights is None:
                raise RuntimeError("the attention module returned no weights: the model must use eager attention")
            self.spans[index] = lifespans(weights[0].to(torch.float32), self.rule, self.first, self.count,
                                          self.groups).T  # [count, groups]
        return hook


def windows(ids: list[int], rule: LifespanRule) -> list[tuple[int, list[int]]]:
    """(index of the window's first text token, the window's text tokens) for every window
    that has a full horizon after its labelled span. BOS is prepended by the caller."""
    step, span = rule.labelled_per_window, rule.window - 1
    return [(start, ids[start:start + span]) for start in range(0, len(ids) - span + 1, step)]


@torch.no_grad()
def label_text(lm, text: str, rule: LifespanRule, *, max_tokens: int | None = None, name: str = "",
               on_window=None, per_head: bool = False) -> LabelSet:
    """Labels of every token of `text` that a window covers with a whole horizon.

    lm: a positronic.models.LoadedModel (Llama). max_tokens: read only the first this many
    text tokens. on_window(): called after each window (progress). per_head: a lifespan per
    kv head, not per layer. Returns a LabelSet with one entry per labelled token, in text order.
    """
    ids = lm.encode(text)[: max_tokens or None]
    spans = windows(ids, rule)
    if not spans:
        raise ValueError(f"text {name or ''} has {len(ids)} tokens; a window needs {rule.window - 1}")
    model = lm.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    keys: list[list[torch.Tensor]] = [[] for _ in range(lm.num_layers)]
    labels: list[list[torch.Tensor]] = [[] for _ in range(lm.num_layers)]
    try:
        with LabelRecorder(model, rule, lm.num_kv_heads if per_head else 1) as recorder:
            recorder.first, recorder.count = 1, rule.labelled_per_window
            for _, chunk in spans:
                window = torch.tensor([[lm.bos_id] + chunk], device=lm.device)
                model.model(input_ids=window, use_cache=False)  # the base model: no logits needed
                for l in range(lm.num_layers):
                    keys[l].append(recorder.keys[l])
                    labels[l].append(log4(recorder.spans[l] + 1))
                if on_window is not None:
                    on_window()
    finally:
        model.set_attn_implementation(previous)
    return LabelSet(keys=[torch.cat(k) for k in keys], labels=[torch.cat(y) for y in labels], rule=rule,
                    texts=[name] if name else [])


def window_count(lm, text: str, rule: LifespanRule, max_tokens: int | None = None) -> int:
    """How many prefills `label_text` will run (for a progress bar)."""
    return len(windows(lm.encode(text)[: max_tokens or None], rule))
