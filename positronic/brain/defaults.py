"""The policy a run gets when none is asked for: the best measured for its model.

Where SmartKV gates exist for the model (shipped, as for SmolLM2, or given with --gates),
the default is SmartKV with recall, each lane's memory ranked by the gates and by recent use
(`--memory-rank recent`, BrainConfig's default with recall since 2026-11-29: at or below every
kvpress press in all 14 cells, within 1.03x of the full cache at 25% on seven texts; docs/
policies.md, "Its memory ranked by recent use too"). With the gates' rank alone SmartKV has the lowest
teacher-forced perplexity of the project's policies at 12.5% and 25% budgets on every text
measured, held-out ones included (with recall lower in 8 of 12 cells, within 3.4% in the
others; below every kvpress press in 7 of 8 cells, 0.03 above one in the eighth), and with
recall it keeps the retrieval probe's fact (2,000 tokens back) within 1 nat on five of six texts
measured (Dracula lost; with the recent-use rank four: Frankenstein lost too; docs/policies.md, "The default";
bench/results/history/smartkv.md, recall.md, kvpress.md). `--no-recall` turns recall off.

For a model without shipped gates, `run` and `serve` (`train=True`) choose SmartKV too, on
gates trained on the model's first use from the package's own text and kept
(smartkv/first_use.py: about a minute for SmolLM2-135M on 2 cores); where none can be trained
(random weights, whose attention tells no token from another) the default is brightness, a
gate-free policy, recall as asked, and the note says how to train gates.

A setting SmartKV cannot take (a repairer, the ring store) keeps the
gate-free default too: the user asked for that setting, not for a policy.

    choice = default_policy("smollm2", BrainConfig(budget=256))
    choice.policy, choice.recall, choice.note     # "smartkv", True, "policy smartkv with recall, its memory ranked by recent use too (...)"
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import AUTO_GATES, BrainConfig, default_memory_rank

GATE_FREE = "brightness"  # the default where no gates exist for the model
TRAIN_HINT = ("train gates for it with `positronic smartkv train --model {model} --text A.txt --heldout B.txt "
              "--per-head --out gates.safetensors` (about 12 minutes for SmolLM2-135M on a 2-core CPU) and "
              "pass --gates gates.safetensors for its best memory, SmartKV")


@dataclass(frozen=True)
class DefaultPolicy:
    policy: str
    recall: bool
    note: str  # one line for the user: what was chosen and why
    gates: str = ""  # AUTO_GATES: SmartKV on gates trained on the model's first use (smartkv/first_use.py)


def has_gates(model: str, gates: str = "") -> bool:
    """Whether SmartKV can run on `model` without training: gates given, or shipped for it."""
    from ..smartkv.gates import SHIPPED

    return bool(gates) or model in SHIPPED


def trainable(model: str) -> bool:
    """Whether gates can be trained for `model` on its first use: not for random weights, whose
    attention tells no token from another (smartkv/first_use.py measures that, and says so)."""
    return not model.startswith("random:")


def default_policy(model: str, config: BrainConfig, *, window: int | None = None,
                   recall: bool | None = None, memory_rank: str | None = None, train: bool = False) -> DefaultPolicy:
    """The default policy for `model` given the run's other settings (`config`, whose own
    policy, window, recall and memory rank are ignored; `window`, `memory_rank`: the ones asked
    for, None for the policy's own; `recall`: as asked, None for the default's): SmartKV with
    recall (its memory ranked by recent use too) where gates exist, or with `train` can be
    trained on the model's first use (gates AUTO_GATES, resolved once the model is loaded), and
    the settings allow it; else brightness (recall only if asked)."""
    asked = bool(recall)
    shipped = has_gates(model, config.gates)
    if not shipped and not (train and trainable(model)):
        return DefaultPolicy(GATE_FREE, asked, f"policy {GATE_FREE}: no SmartKV gates ship for {model}; "
                                               + TRAIN_HINT.format(model=model))
    recall = True if recall is None else recall
    rank = memory_rank or default_memory_rank("smartkv", recall)
    named = ("policy smartkv" + (" with recall" if recall else " without recall (--no-recall)")
             + (", its memory ranked by recent use too (--memory-rank recent)" if rank == "recent" else ""))
    if config.gates:  # asked for SmartKV's gates: what they cannot run with is an error, not a fallback
        return DefaultPolicy("smartkv", recall, f"{named}, with the gates given (--policy NAME for another)")
    gates = "" if shipped else AUTO_GATES
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    smart = BrainConfig(**fields | {"policy": "smartkv", "window": window, "recall": recall, "memory_rank": memory_rank,
                                    "reread": None, "gates": gates})
    try:
        smart.validate()
    except ValueError as exc:
        return DefaultPolicy(GATE_FREE, asked, f"policy {GATE_FREE}: the best measured default, SmartKV, "
                                               f"cannot run with these settings ({exc})")
    if not shipped:
        return DefaultPolicy("smartkv", recall, f"{named}, on gates trained for {model} on its first use and kept "
                                                "(docs/smartkv.md, \"Gates on first use\"; --policy NAME for another)",
                             gates)
    return DefaultPolicy("smartkv", recall, f"{named}: the best measured for {model} "
                                            "(docs/policies.md, \"The default\"; --policy NAME for another)")
