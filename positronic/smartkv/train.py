"""Training the SmartKV gates: labels from the model's own attention, one MLP per layer.

    python -m positronic.smartkv train --model smollm2 --text texts/alice_ch1-2.txt \
        --text more.txt --heldout /work/heldout/tale_of_two_cities.txt --out gates.safetensors

Steps: (1) label every training text and the held-out text (labels.py: one eager prefill per
window); (2) per layer, standardise the keys and fit the MLP to log4(1 + lifespan) by mean
squared error (AdamW, linear learning-rate decay), keeping the epoch with the best rank
correlation on a 10% validation split of the *training* labels; (3) report Spearman's rank
correlation per layer on the held-out text (the gates only rank rows, so ranks are what
matters) and write the gates with a JSON header recording the rule, texts and results.
`per_head`: a lifespan per kv head (labels.py) and a gate output per kv head; a layer's
Spearman is then the mean over its kv heads.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .gates import DEFAULT_DEPTH, DEFAULT_HIDDEN, Gate, GateSet, spearman
from .labels import LabelSet, LifespanRule, label_text, window_count
from ..util import error_line, read_text_file


# Sanity bounds, far past what was measured (256 wide, depth 3: 0.1M weights a layer): at
# 4,096 wide a depth-3 gate holds 17M weights, more than a SmolLM2-135M layer it ranks rows for
# (4.5M); past these a value is a typo that would allocate only after minutes of labelling.
MAX_HIDDEN = 4096
MAX_DEPTH = 16


@dataclass(frozen=True)
class TrainConfig:
    hidden: int = DEFAULT_HIDDEN
    depth: int = DEFAULT_DEPTH
    epochs: int = 8
    batch: int = 512
    lr: float = 2e-3
    weight_decay: float = 1e-4
    validation: float = 0.1   # share of the training labels held back to pick the best epoch
    seed: int = 0

    def check(self) -> None:
        """ValueError naming the first setting no training can use (the message starts with
        its name): none of them may leave a file of untrained or NaN gates behind."""
        for name, low, high in (("hidden", 1, MAX_HIDDEN), ("depth", 1, MAX_DEPTH), ("epochs", 1, None),
                                ("batch", 1, None), ("seed", 0, 2**63 - 1)):
            value = getattr(self, name)
            if value < low or (high is not None and value > high):
                bounds = f"in {low}..{high}" if high is not None else f">= {low}"
                raise ValueError(f"{name} must be {bounds}, got {value}")
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0) or (name == "lr" and value == 0):
                raise ValueError(f"{name} must be a finite number {'> 0' if name == 'lr' else '>= 0'}, got {value}")
        if not 0 < self.validation < 1:
            raise ValueError(f"validation must be a share in (0, 1), got {self.validation}")


def check_rule(horizon: int, threshold: float, window: int) -> None:
    """ValueError (starting with the setting's name) for a lifespan rule no useful label could
    come out of. Attention is at most 1 and a window shows at most `window` rows, so a token
    counts as used only if threshold < window; NaN would label every token unused."""
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    if window < horizon + 2:
        raise ValueError(f"window {window} leaves no token with a whole horizon of {horizon} after it "
                         f"(it must be at least horizon + 2)")
    if not (math.isfinite(threshold) and 0 < threshold < window):
        raise ValueError(f"threshold must be a finite number in (0, window = {window}): attention above "
                         f"threshold / rows is never reached past that, got {threshold}")


def split(count: int, share: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, validation indices) of a random split of `count` samples."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    held = max(1, int(round(count * share))) if count > 1 else 0
    return order[held:], order[:held]


def mean_spearman(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Spearman of [n, heads] predictions against labels, averaged over the heads."""
    return sum(spearman(predicted[:, h], labels[:, h]) for h in range(labels.shape[1])) / labels.shape[1]


def fit_gate(keys: torch.Tensor, labels: torch.Tensor, config: TrainConfig, *, on_step=None) -> tuple[Gate, float]:
    """Fit one Gate to pre-RoPE keys [n, in_dim] and labels [n, heads]. Returns the gate of the
    best epoch by validation Spearman (mean over heads), and that Spearman. on_step(): called
    once per batch."""
    torch.manual_seed(config.seed)
    train_idx, val_idx = split(keys.shape[0], config.validation, config.seed)
    gate = Gate(keys.shape[1], config.hidden, config.depth, heads=labels.shape[1])
    gate.set_normalisation(keys[train_idx])
    optimiser = torch.optim.AdamW(gate.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(len(train_idx) / config.batch)
    total = steps_per_epoch * config.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda step: 1.0 - step / max(1, total))
    best_state, best = copy.deepcopy(gate.state_dict()), -float("inf")
    x_train, y_train = keys[train_idx], labels[train_idx]
    for epoch in range(config.epochs):
        gate.train()
        order = torch.randperm(len(train_idx))
        for start in range(0, len(order), config.batch):
            batch = order[start:start + config.batch]
            loss = torch.nn.functional.mse_loss(gate(x_train[batch]), y_train[batch])
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            schedule.step()
            if on_step is not None:
                on_step()
        gate.eval()
        with torch.no_grad():
            rho = mean_spearman(gate(keys[val_idx]), labels[val_idx]) if len(val_idx) > 1 else 0.0
        if rho > best or epoch == 0:
            best, best_state = rho, copy.deepcopy(gate.state_dict())
    gate.load_state_dict(best_state)
    return gate.eval().requires_grad_(False), best


def train_gates(labels: LabelSet, config: TrainConfig, *, shared: bool = False, on_step=None,
                header: dict | None = None) -> GateSet:
    """Per-layer gates (or, `shared`, one gate fitted to every layer's labels pooled)."""
    head = {"lifespan": labels.rule.to_dict(), "train": asdict(config), "texts": labels.texts}
    head.update(header or {})
    if shared:
        keys = torch.cat(labels.keys)
        targets = torch.cat(labels.labels)
        # as many optimiser steps as all per-layer gates together: one epoch over the pool is
        # one epoch of every layer
        gate, _ = fit_gate(keys, targets, config, on_step=on_step)
        gates = [gate] * labels.num_layers
    else:
        gates = [fit_gate(labels.keys[l], labels.labels[l], config, on_step=on_step)[0]
                 for l in range(labels.num_layers)]
    result = GateSet(gates, {})
    result.header = dict(head, format=1, num_layers=result.num_layers, in_dim=result.in_dim,
                         hidden=config.hidden, depth=config.depth, heads=labels.heads, shared=shared)
    return result


def steps_needed(labels: LabelSet, config: TrainConfig, shared: bool) -> int:
    """Optimiser steps `train_gates` will take (for a progress bar)."""
    train = labels.count - (max(1, int(round(labels.count * config.validation))) if labels.count > 1 else 0)
    per_layer = math.ceil(train / config.batch) * config.epochs
    if shared:
        pool = labels.count * labels.num_layers
        train = pool - max(1, int(round(pool * config.validation)))
        return math.ceil(train / config.batch) * config.epochs
    return per_layer * labels.num_layers


@torch.no_grad()
def check_informative(labels: LabelSet, source: str) -> None:
    """ValueError unless every layer's (and head's) labels take more than one value: with one,
    the model's attention tells no token from another there (a model of random weights does
    this), so a gate has nothing to learn and Spearman's rank correlation is undefined."""
    flat = [layer for layer in range(labels.num_layers)
            if any(bool((column == column[0]).all()) for column in labels.labels[layer].T)]
    if flat:
        value = float(labels.labels[flat[0]].flatten()[0])
        raise ValueError(f"{source}: every token has the same lifespan label in layer{'s' * (len(flat) > 1)} "
                         f"{', '.join(map(str, flat[:8]))}{' ...' if len(flat) > 8 else ''} ({value:g}): the model's "
                         "attention tells no token from another there (random weights?), so there is nothing to "
                         "train or measure; nothing was written")


def check_finite(gates: GateSet, what: str, config: TrainConfig) -> None:
    """ValueError if training diverged (NaN or infinite weights in `gates`)."""
    if not all(bool(t.isfinite().all()) for g in gates.gates for t in g.state_dict().values()):
        raise ValueError(f"training diverged: {what} hold NaN or infinite weights (lower --lr, now {config.lr:g}); "
                         "nothing was written")


def ranked_heldout(gates: GateSet, labels: LabelSet) -> list[float]:
    """`heldout_spearman`, recorded in the gates' header; ValueError where a layer's correlation
    is undefined (the gates give every held-out token one score: they cannot rank a memory)."""
    rho = heldout_spearman(gates, labels)
    if undefined := [layer for layer, r in enumerate(rho) if not math.isfinite(r)]:
        raise ValueError(f"the gates predict one score for every held-out token in layer"
                         f"{'s' * (len(undefined) > 1)} {', '.join(map(str, undefined[:8]))}: their rank correlation "
                         "is undefined, so they cannot rank a memory; nothing was written")
    gates.header["heldout_spearman"] = [round(r, 4) for r in rho]
    return rho


def heldout_spearman(gates: GateSet, labels: LabelSet) -> list[float]:
    """Spearman correlation of predicted and true labels, per layer (per-head gates: the mean
    over the layer's kv heads)."""
    if gates.heads != labels.heads:
        raise ValueError(f"the gates score {gates.heads} heads per layer, the labels have {labels.heads}")
    return [mean_spearman(gates.score(l, labels.keys[l]), labels.labels[l]) for l in range(labels.num_layers)]


# --- the command ------------------------------------------------------------------------------

@dataclass
class TrainReport:
    gates: GateSet
    shared: GateSet | None
    heldout: list[float]
    heldout_shared: list[float] | None
    train_count: int
    heldout_count: int
    seconds: float


def run(*, model: str, texts: list[Path], heldout: Path, out: Path, shared_out: Path | None = None,
        rule: LifespanRule = LifespanRule(), config: TrainConfig = TrainConfig(), max_tokens: int | None = None,
        save_labels: Path | None = None, labels: Path | None = None, per_head: bool = False,
        console=None) -> TrainReport:
    """Label, train, evaluate, write (see the module docstring). Progress goes to `console`
    (a rich Console on stderr by default)."""
    from rich.console import Console

    from ..models import load_model

    console = console or Console(stderr=True)
    started = time.perf_counter()
    config.check()
    # files first: a missing or unusable text is reported before the model loads
    texts_read = [(Path(p).name, _read(p, "--text")) for p in texts]
    held_text = _read(heldout, "--heldout")
    train_names = {Path(p).resolve() for p in texts}
    if Path(heldout).resolve() in train_names:
        raise ValueError(f"--heldout {heldout} is also a training --text: the held-out measurement needs an unseen text")
    train_labels = None if labels is None else _load_labels(Path(labels), per_head)
    try:
        if train_labels is not None:
            rule = train_labels.rule  # the rule the labels were made with
        check_rule(rule.horizon, rule.threshold, rule.window)
    except ValueError as exc:
        raise ValueError(f"--labels {labels}: its lifespan rule: {exc}" if train_labels is not None else str(exc)) \
            from None
    _check_windows(rule, max_tokens, ([] if labels is not None else texts_read) + [(Path(heldout).name, held_text)])
    lm = load_model(model, device="cpu", dtype="float32")
    with Bars(console) as bars:
        if labels is not None:
            total_windows = window_count(lm, held_text, rule, max_tokens)
        else:
            total_windows = sum(window_count(lm, t, rule, max_tokens) for _, t in texts_read) \
                + window_count(lm, held_text, rule, max_tokens)
        advance = bars.task("labels", total_windows)
        if labels is None:
            train_labels = LabelSet.concat([label_text(lm, t, rule, max_tokens=max_tokens, name=n, on_window=advance,
                                                       per_head=per_head) for n, t in texts_read])
            check_informative(train_labels, "the training text")
            if save_labels is not None:
                train_labels.save(save_labels)
        if labels is not None:
            check_informative(train_labels, f"--labels {labels}")
        held_labels = label_text(lm, held_text, rule, max_tokens=max_tokens, name=Path(heldout).name,
                                 on_window=advance, per_head=per_head)
        check_informative(held_labels, f"--heldout {Path(heldout).name}")
        steps = steps_needed(train_labels, config, False) + (steps_needed(train_labels, config, True) if shared_out else 0)
        advance = bars.task("gates", steps)
        header = {"model": model, "heldout": Path(heldout).name}
        gates = train_gates(train_labels, config, on_step=advance, header=header)
        shared = None
        if shared_out is not None:
            shared = train_gates(train_labels, config, shared=True, on_step=advance, header=header)
    for name, trained in (("--out", gates), ("--shared-out", shared)):
        if trained is not None:
            check_finite(trained, f"the gates for {name}", config)
    rho = ranked_heldout(gates, held_labels)
    gates.save(out)
    rho_shared = None
    if shared is not None:
        rho_shared = heldout_spearman(shared, held_labels)
        shared.header["heldout_spearman"] = [round(r, 4) for r in rho_shared]
        shared.save(shared_out)
    return TrainReport(gates, shared, rho, rho_shared, train_labels.count, held_labels.count,
                       time.perf_counter() - started)


class Bars:
    """Progress: rich bars on a terminal; elsewhere (a pipe, a log file) one line per tenth of
    each task, since bars cannot redraw there."""

    def __init__(self, console):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(TextColumn("{task.description:>8}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not self.live)
        self.started = time.perf_counter()

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def task(self, name: str, total: int):
        """A callable that advances a new task by one."""
        task = self.progress.add_task(name, total=total)
        done = [0]

        def advance():
            self.progress.advance(task)
            done[0] += 1
            if not self.live and (done[0] == total or done[0] * 10 // total != (done[0] - 1) * 10 // total):
                self.console.print(f"{name} {done[0]}/{total}  {time.perf_counter() - self.started:.0f} s",
                                   highlight=False)
        return advance


def report_table(report: TrainReport, heldout_name: str):
    """A rich Table: held-out Spearman per layer (and of the shared gate, if trained)."""
    from rich.table import Table

    table = Table(title=f"held-out Spearman per layer ({heldout_name}, {report.heldout_count} tokens; "
                        f"trained on {report.train_count} tokens)")
    table.add_column("layer", justify="right")
    per_head = report.gates.heads > 1  # a layer's figure: the mean over its kv heads
    table.add_column("per-layer gate" + (" (mean of kv heads)" if per_head else ""), justify="right")
    if report.heldout_shared is not None:
        table.add_column("shared gate", justify="right")
    for l, rho in enumerate(report.heldout):
        row = [str(l), f"{rho:.3f}"]
        if report.heldout_shared is not None:
            row.append(f"{report.heldout_shared[l]:.3f}")
        table.add_row(*row)
    mean = [f"{sum(report.heldout) / len(report.heldout):.3f}"]
    if report.heldout_shared is not None:
        mean.append(f"{sum(report.heldout_shared) / len(report.heldout_shared):.3f}")
    table.add_row("mean", *mean, end_section=True)
    return table


def _load_labels(path: Path, per_head: bool) -> LabelSet:
    """--labels' LabelSet, read (safetensors: no code runs) before any model loads; ValueError
    naming the file when it is not one that --save-labels wrote."""
    from positronic.mirror.storage import regular_file

    try:
        regular_file(path)  # a FIFO named here is refused, not waited on
    except FileNotFoundError:
        raise ValueError(f"--labels {path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"--labels {path}: {exc.strerror or exc}") from None
    try:
        labels = LabelSet.load(path)
    except Exception as exc:  # safetensors, JSON and the rule's own checks raise unrelated types
        raise ValueError(f"--labels {path}: not a label file written by --save-labels ({error_line(exc)})") from None
    if (labels.heads > 1) != per_head:
        raise ValueError(f"--labels {path} holds {'per-head' if labels.heads > 1 else 'per-layer'} "
                         f"lifespans; {'add' if labels.heads > 1 else 'drop'} --per-head")
    return labels


def _check_windows(rule: LifespanRule, max_tokens: int | None, texts: list[tuple[str, str]]) -> None:
    """ValueError, before the model loads, for a text that cannot fill one labelling window
    (its tokens are counted once the model loads; this bound needs none: a token covers a
    byte at least, but for a word-start marker SentencePiece may put alone first)."""
    need = rule.window - 1
    if max_tokens is not None and max_tokens < need:
        raise ValueError(f"--max-tokens {max_tokens} is fewer than the {need} text tokens a --window of {rule.window} "
                         "needs")
    for name, text in texts:
        if len(text.encode("utf-8")) + 1 < need:
            raise ValueError(f"--window {rule.window} needs {need} tokens of each text; {name} holds at most "
                             f"{len(text.encode('utf-8')) + 1}")


def _read(path, flag: str) -> str:
    text = read_text_file(Path(path), flag)
    if not text.strip():
        raise ValueError(f"{flag} {path} is empty")
    return text
