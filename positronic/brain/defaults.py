"""The policy a run gets when none is asked for: the best measured for its model.

Where SmartKV gates exist for the model (shipped, as for SmolLM2, or given with --gates),
the default is SmartKV: it has the lowest teacher-forced perplexity of the project's policies
at 12.5% and 25% budgets on every text measured, held-out ones included (docs/policies.md,
"The default"; bench/results/smartkv.md). Recall stays off: under SmartKV it moves perplexity
by -1.0% to +1.0% and, as measured so far, does not bring a fact back from 2,000 tokens
(bench/results/recall.md, 2026-11-26); `--recall` turns it on. Without gates the default stays
brightness, a gate-free policy, and the note says how to train gates.

A setting SmartKV cannot take (a repairer, a 4-bit kv_format, the ring store) keeps the
gate-free default too: the user asked for that setting, not for a policy.

    choice = default_policy("smollm2", BrainConfig(budget=256))
    choice.policy, choice.recall, choice.note     # "smartkv", False, "policy smartkv: the best measured (...)"
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import BrainConfig

GATE_FREE = "brightness"  # the default where no gates exist for the model
TRAIN_HINT = ("train gates for it with `positronic smartkv train --model {model} --text A.txt --heldout B.txt "
              "--per-head --out gates.safetensors` (about 12 minutes for SmolLM2-135M on a 2-core CPU) and "
              "pass --gates gates.safetensors for its best memory, SmartKV")


@dataclass(frozen=True)
class DefaultPolicy:
    policy: str
    recall: bool
    note: str  # one line for the user: what was chosen and why


def has_gates(model: str, gates: str = "") -> bool:
    """Whether SmartKV can run on `model`: gates given, or shipped for it."""
    from ..smartkv.gates import SHIPPED

    return bool(gates) or model in SHIPPED


def default_policy(model: str, config: BrainConfig, *, window: int | None = None) -> DefaultPolicy:
    """The default policy for `model` given the run's other settings (`config`, whose own
    policy and window are ignored; `window`: the one asked for, None for the policy's own):
    SmartKV where gates exist and the settings allow it, else brightness (recall as the
    settings say)."""
    if not has_gates(model, config.gates):
        return DefaultPolicy(GATE_FREE, config.recall, f"policy {GATE_FREE}: no SmartKV gates ship for {model}; "
                                                         + TRAIN_HINT.format(model=model))
    if config.gates:  # asked for SmartKV's gates: what they cannot run with is an error, not a fallback
        return DefaultPolicy("smartkv", config.recall, "policy smartkv, with the gates given (--policy NAME for another)")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    smart = BrainConfig(**fields | {"policy": "smartkv", "window": window})
    try:
        smart.validate()
    except ValueError as exc:
        return DefaultPolicy(GATE_FREE, config.recall, f"policy {GATE_FREE}: the best measured default, SmartKV, "
                                                         f"cannot run with these settings ({exc})")
    return DefaultPolicy("smartkv", config.recall, f"policy smartkv: the best measured for {model} "
                                          "(docs/policies.md, \"The default\"; --policy NAME for another)")
