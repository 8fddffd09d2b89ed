"""kvpress-style use: any policy as the cache of a user's own `model.generate()`.

    with positronic.press(model, tokenizer, policy="h2o", budget=256):      # or compression_ratio=0.75
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)   # a padded batch, as always

Inside the block `model.generate` is this module's `generate`: each row of the batch (its
padding taken off by `attention_mask`, left or right) becomes a `Brain` with the press's policy
and budget, and the rows tick together as one `Batch` (Core v4's engine rounds where the policy
runs there, else one shared forward): each row gets exactly the tokens it gets alone, at any
batch size, and its context never grows past its budget. The result is what `generate` returns:
`[batch, prompt + new]` token ids, the prompt as given, each row's tokens after it, `pad_token_id`
after a row's end-of-sequence token. The model's own generation config gives the defaults
(greedy unless `do_sample`; temperature, top_k, top_p, min_p, repetition_penalty), and a call's
arguments override them.

What differs from kvpress: the budget holds for the whole generation (kvpress's presses compress
the prompt once and let decoding grow); `compression_ratio` r sets each row's budget to its
prompt's length x (1 - r) (a budget too small for the policy is refused, naming the row). Sampling draws with each row's own
seeded generator (`seed`, +1 per row: row i of a batch is the run of seed + i alone), not torch's
global one. Beam search keeps several hypotheses of one sequence in one cache, which a policy
that edits each sequence's rows does not do: `num_beams` > 1 is refused, as are the options
that return more than token ids (`return_dict_in_generate`, `output_scores`, a streamer); an
argument `generate` does not know is refused by name.

On leaving the block the model is as it was: its `generate`, its attention implementation, its
training mode and which parameters want gradients, and its linear layers (the brain computes float32 CPU products row-invariantly: models/linear.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import sys

import torch
from torch import nn

from ..brain.config import AUTO_GATES, BrainConfig, ConfigError
from ..brain.loop import Brain
from ..models.loading import LoadedModel, wrap_model
from .brains import Batch

REFUSED = {"num_beams": (1, "beam search keeps several hypotheses of one sequence in one cache, which an evicting "
                            "policy's per-sequence edits do not allow"),
           "num_return_sequences": (1, "one sequence per row: repeat the row in the batch instead"),
           "return_dict_in_generate": (False, "only token ids are returned"),
           "output_scores": (False, "only token ids are returned"),
           "output_logits": (False, "only token ids are returned"),
           "output_attentions": (False, "only token ids are returned"),
           "output_hidden_states": (False, "only token ids are returned")}
TAKEN = {"input_ids", "inputs", "attention_mask", "generation_config", "max_new_tokens", "max_length", "do_sample",
         "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "eos_token_id", "pad_token_id",
         "bos_token_id", "use_cache", *REFUSED}


@contextlib.contextmanager
def press(model, tokenizer=None, *, policy: str = "default", budget: int | None = None,
          compression_ratio: float | None = None, seed: int = 0, **settings):
    """Within the block, `model.generate` keeps each row's context inside `budget` rows (or
    `compression_ratio` of its prompt removed) with `policy` ("default": the project's default
    for the model, SmartKV with recall on the gates shipped for it or else trained on its first use
    and kept, brightness where none can be: smartkv/first_use.py); `settings`:
    any other BrainConfig field (window, sinks, recall, ...). ValueError for a bad setting, before
    the model is touched. `model` may also be a LoadedModel (`load_model("smollm2")`): its
    model, tokenizer and name (which picks the default policy's gates) are used."""
    name = None
    if isinstance(model, LoadedModel):
        model, tokenizer, name = model.model, tokenizer or model.tokenizer, model.name
    if tokenizer is None:
        raise ValueError("press needs the model's tokenizer (its BOS and end-of-sequence tokens, and the text of ticks)")
    if (budget is None) == (compression_ratio is None):
        raise ValueError("give one of budget (rows per sequence) and compression_ratio (the share of a prompt's "
                         "rows to remove, 0 <= r < 1)")
    if compression_ratio is not None and not 0 <= compression_ratio < 1:
        raise ValueError(f"compression_ratio must be in [0, 1), got {compression_ratio}")
    if "generate" in vars(model):
        raise ValueError("model.generate is already replaced (a press inside a press?)")
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    attention, training = model.config._attn_implementation, model.training
    trained = [p for p in model.parameters() if p.requires_grad]
    name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
    base = _config(name, policy, budget if budget is not None else 0, seed, settings)  # refused before any change
    try:
        lm = wrap_model(model, tokenizer, name)
        base = _with_gates(lm, base, settings)
        model.generate = lambda *args, **kwargs: generate(lm, base, compression_ratio, *args, **kwargs)
        yield lm
    finally:
        vars(model).pop("generate", None)
        for module in linears:
            module.__class__ = nn.Linear
            module.__dict__.pop("_onednn_weight", None)
        model.set_attn_implementation(attention)
        model.train(training)
        for parameter in trained:
            parameter.requires_grad_(True)


def _with_gates(lm, config: BrainConfig, settings: dict) -> BrainConfig:
    """The default policy's gates "auto" made a file (kept, or trained now on the model's first
    use: smartkv/first_use.py, its lines on stderr); where none can be trained, the gate-free
    default, said on stderr with the reason."""
    if config.gates != AUTO_GATES or "gates" in settings:
        return config
    from ..smartkv.first_use import GateTrainingError, resolve

    try:
        return dataclasses.replace(config, gates=resolve(lm))
    except GateTrainingError as exc:
        from ..brain.defaults import default_policy

        free = default_policy(lm.name, dataclasses.replace(config, gates=""), window=settings.get("window"))
        print(f"positronic.press: {free.note} ({exc})", file=sys.stderr, flush=True)
        return dataclasses.replace(config, policy=free.policy, recall=free.recall, gates="", memory_rank=None,
                                   reread=None, window=settings.get("window"))


def _config(name: str, policy: str, budget: int, seed: int, settings: dict) -> BrainConfig:
    names = {f.name for f in dataclasses.fields(BrainConfig)}
    if unknown := sorted(set(settings) - names):
        raise ValueError(f"press: {', '.join(unknown)} is not a setting of the brain (BrainConfig)")
    settings = ({"budget": budget} if budget else {}) | dict(seed=seed) | settings
    if policy == "default":
        from ..brain.defaults import default_policy
        choice = default_policy(name, BrainConfig(**settings), window=settings.get("window"), train=True)
        settings |= dict(policy=choice.policy, recall=choice.recall) | ({"gates": choice.gates} if choice.gates else {})
    else:
        settings |= dict(policy=policy)
    config = BrainConfig(**settings)  # made once: a window the policy does not read is the user's, refused
    if budget:
        config.validate()
    return config


@torch.no_grad()
def generate(lm, base: BrainConfig, compression_ratio: float | None, input_ids=None, **kwargs) -> torch.LongTensor:
    """`model.generate` inside `press` (the module docstring): [batch, prompt + new] ids."""
    input_ids = kwargs.pop("inputs", input_ids)
    if input_ids is None:
        raise ValueError("generate needs input_ids")
    if unknown := sorted(set(kwargs) - TAKEN):
        raise TypeError(f"generate under a positronic press does not take {', '.join(unknown)}")
    config = copy.deepcopy(kwargs.pop("generation_config", None) or lm.model.generation_config)
    mask = kwargs.pop("attention_mask", None)
    kwargs.pop("use_cache", None)
    config.update(**kwargs)
    for name, (plain, why) in REFUSED.items():
        if getattr(config, name, plain) not in (plain, None):
            raise ValueError(f"{name}={getattr(config, name)!r} is not supported under a positronic press: {why}")
    ids = torch.as_tensor(input_ids)
    ids = ids[None] if ids.dim() == 1 else ids
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - ids.shape[1]
    if new < 1:
        raise ValueError(f"nothing to generate: max_new_tokens (or max_length - prompt) is {new}")
    eos = config.eos_token_id if config.eos_token_id is not None else lm.eos_id
    enders = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    pad = config.pad_token_id if config.pad_token_id is not None else min(enders, default=0)
    sampling = dict(temperature=float(config.temperature or 1.0) if config.do_sample else 0.0,
                    top_k=int(config.top_k or 0) if config.do_sample else 0,
                    top_p=float(config.top_p if config.top_p is not None else 1.0) if config.do_sample else 1.0,
                    min_p=float(config.min_p or 0.0) if config.do_sample else 0.0,
                    repetition_penalty=float(config.repetition_penalty or 1.0))
    batch = Batch()
    for row in range(ids.shape[0]):
        prompt = ids[row][mask[row].bool()].tolist()
        if not prompt:
            raise ValueError(f"row {row} has no tokens (its attention_mask is all 0)")
        budget = base.budget
        if compression_ratio is not None:
            budget = math.ceil(len(prompt) * (1 - compression_ratio))
        row_config = dataclasses.replace(base, budget=budget, seed=base.seed + row, **sampling)
        try:
            row_config.validate()
            brain = Brain.start(lm, prompt, row_config)
        except ConfigError as exc:
            if compression_ratio is None:
                raise
            raise ValueError(f"compression_ratio {compression_ratio} gives row {row} ({len(prompt)} prompt tokens) a "
                             f"budget of {budget} rows, too few for policy {base.policy}: {exc}") from None
        batch.join(row, brain)
    made: dict[int, list[int]] = {row: [] for row in range(ids.shape[0])}
    for _ in range(new):
        for row, record in batch.step().items():
            if isinstance(record, Exception):
                raise record
            if not record.rebuilt:
                made[row].append(record.token_id)
            if record.token_id in enders or len(made[row]) == new or record.stopped:
                batch.leave(row)
        if not len(batch):
            break
    width = max(map(len, made.values()))
    out = torch.full((ids.shape[0], ids.shape[1] + width), pad, dtype=ids.dtype, device=ids.device)
    out[:, :ids.shape[1]] = ids
    for row, tokens in made.items():
        out[row, ids.shape[1]:ids.shape[1] + len(tokens)] = torch.tensor(tokens, dtype=ids.dtype)
    return out
