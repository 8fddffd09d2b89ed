"""SmartKV gates for a model that ships none: trained on its first use, kept, and reused.

    path = gates_for(lm)   # the kept file, or gates trained now (SmolLM2-135M: about a minute on 2 cores)

`--gates auto` (and the default policy of a model without shipped gates, brain/defaults.py)
comes here once the model is loaded. The gates learn from the model's own attention over the
text the package ships (texts/alice_ch1-2.txt): its first three quarters are labelled for
training and the last quarter is held out, where each layer's rank correlation is measured and
written into the file's header, as `smartkv train` does with texts of the user's choosing
(docs/smartkv.md, "Gates on first use").

They are kept in $POSITRONIC_CACHE/gates/ (default ~/.cache/positronic/gates/), named by the
model and a fingerprint of its weights (its config and a sample of every tensor's values), so
another checkpoint under the same name trains its own. A kept file is used only if it reads as
a gate file, its header names this fingerprint and recipe, and it fits the model; anything else
(a truncated write, another model's gates, a changed recipe) is trained again and replaced, and
the line printed says so. Writes are atomic (a temporary file renamed).

A model whose attention tells no token from another (random weights, mostly) has nothing to
learn: `GateTrainingError` says so, and the default policy stays gate-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path

import torch

from .gates import GateFileError, GateSet
from .labels import LifespanRule, label_text, window_count
from .train import TrainConfig, check_finite, check_informative, ranked_heldout, steps_needed, train_gates

RECIPE = 1  # bump when the text, rule or training below change: kept gates are then trained again
TRAIN_SHARE = 0.75  # of the shipped text's characters, cut at a paragraph; the rest is held out
SAMPLE = 64  # values read from each end of every tensor for the fingerprint


class GateTrainingError(ValueError):
    """Gates could not be trained for this model (its attention is uninformative, or training
    diverged): the message says why; nothing was kept."""


def fingerprint(lm) -> str:
    """sha256 (hex, 16 digits) of the model's config and the first and last SAMPLE values of
    every parameter and buffer: the same checkpoint gives the same print in any process."""
    digest = hashlib.sha256(lm.model.config.to_json_string(use_diff=False).encode())
    digest.update(f"recipe {RECIPE}".encode())
    for name, tensor in sorted([*lm.model.named_parameters(), *lm.model.named_buffers()]):
        flat = tensor.detach().reshape(-1)
        ends = torch.cat([flat[:SAMPLE], flat[-SAMPLE:]]).to("cpu", torch.float32)
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(ends.numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    from ..models.gguf import cache_root

    return cache_root() / "gates"


def cache_path(lm, printed: str | None = None) -> Path:
    """Where `lm`'s gates are kept: <cache>/gates/<model name, made a file name>-<fingerprint>.safetensors
    (`printed`: its fingerprint, if already taken)."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(lm.name).name or lm.name)[:64]
    return cache_dir() / f"{name}-{printed or fingerprint(lm)}.safetensors"


def kept(lm, path: Path, printed: str | None = None) -> tuple[GateSet | None, str]:
    """(gates, "") if `path` holds gates trained here for this very model (`printed`: its
    fingerprint, if already taken), else (None, why not)."""
    if not path.exists():
        return None, "none kept"
    try:
        gates = GateSet.load(path)
        gates.check_model(lm.model.config)
    except GateFileError as exc:
        return None, f"the kept file is unusable ({exc})"
    made = gates.header.get("first_use", {})
    if made.get("fingerprint") != (printed or fingerprint(lm)) or made.get("recipe") != RECIPE:
        return None, "the kept file was made for other weights or another recipe"
    return gates, ""


def rule_for(lm) -> LifespanRule:
    """The default lifespan rule, its window cut to the model's positions."""
    window = min(LifespanRule.window, lm.max_positions)
    return LifespanRule(horizon=min(LifespanRule.horizon, window // 2), window=window)


def gates_for(lm, *, log=None, bars=None, text: str | None = None, train: TrainConfig = TrainConfig()) -> Path:
    """The path of `lm`'s gates: kept ones, else trained now from the shipped text and kept
    (`text`, `train`: another text and training, for tests). `log(line)` hears what happened
    (stderr by default; two lines when training); `bars` (train.Bars) shows the labelling and
    training as they go. GateTrainingError when nothing can be trained."""
    log = log or _stderr
    printed = fingerprint(lm)  # once: it reads a sample of every tensor
    path = cache_path(lm, printed)
    gates, why = kept(lm, path, printed)
    if gates is not None:
        return path
    from ..texts import DEFAULT_TEXT

    text = DEFAULT_TEXT.read_text(encoding="utf-8") if text is None else text
    cut = text.rfind("\n\n", 0, int(len(text) * TRAIN_SHARE))
    train_text, held_text = text[:cut], text[cut:]
    rule, config = rule_for(lm), train
    log(f"gates: {why} for {lm.name}: training them on {DEFAULT_TEXT.name} (once; kept in {path.parent})")
    started = time.perf_counter()
    task = bars.task if bars is not None else (lambda name, total: None)
    try:
        # the held-out quarter first: a model with nothing to learn is told in a quarter of the time
        labelled = task("labels", window_count(lm, held_text, rule) + window_count(lm, train_text, rule))
        held_labels = label_text(lm, held_text, rule, name="held out", on_window=labelled, per_head=True)
        check_informative(held_labels, f"{lm.name} on {DEFAULT_TEXT.name}")
        train_labels = label_text(lm, train_text, rule, name="training", on_window=labelled, per_head=True)
        check_informative(train_labels, f"{lm.name} on {DEFAULT_TEXT.name}")
        header = {"model": lm.name, "first_use": {"fingerprint": printed, "recipe": RECIPE,
                                                  "text": DEFAULT_TEXT.name, "train_share": TRAIN_SHARE}}
        gates = train_gates(train_labels, config, on_step=task("gates", steps_needed(train_labels, config, False)),
                            header=header)
        check_finite(gates, "the gates", config)
        rho = ranked_heldout(gates, held_labels)
    except ValueError as exc:
        raise GateTrainingError(f"gates: none could be trained for {lm.name}: {exc}") from None
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        gates.save(partial)
        os.replace(partial, path)
    except OSError as exc:  # a read-only or full cache: said, not a traceback
        raise GateTrainingError(f"gates: trained for {lm.name} but not kept in {path.parent}: "
                                f"{exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    log(f"gates: trained for {lm.name} in {time.perf_counter() - started:.0f} s, held-out rank correlation "
        f"{sum(rho) / len(rho):.3f} (mean of {len(rho)} layers); kept as {path}")
    return path


def resolve(lm) -> str:
    """BrainConfig.gates for "auto" on `lm`: "" where gates ship for it, else the path of its
    kept or newly trained gates (`gates_for`, its lines and progress on stderr)."""
    from rich.console import Console

    from .gates import SHIPPED
    from .train import Bars

    if lm.name in SHIPPED:
        return ""
    # progress as lines, not bars: a run's loading spinner may hold the terminal
    with Bars(Console(stderr=True, force_terminal=False)) as bars:
        return str(gates_for(lm, bars=bars))


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)
