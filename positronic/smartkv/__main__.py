"""`positronic smartkv train ...` (also `python -m positronic.smartkv train ...`): label texts, train the gates, report held-out Spearman.

    positronic smartkv train --model smollm2 --text texts/alice_ch1-2.txt \
        --heldout /work/heldout/tale_of_two_cities.txt --out gates.safetensors

Errors print one `error: ...` line naming the option and exit with code 2; every option is
checked before the model loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .labels import LifespanRule
from .train import TrainConfig, check_rule, report_table, run

# the options that set a TrainConfig's or a LifespanRule's field of the same name
SETTINGS = ("hidden", "depth", "epochs", "batch", "lr", "seed", "horizon", "threshold", "window")
RULE = ("horizon", "threshold", "window")  # what --labels brings with it


class Parser(argparse.ArgumentParser):
    """argparse with the commands' refusal: one `error: ...` line naming the option, exit code
    2 (argparse's own prints the usage first, over several lines)."""

    def error(self, message: str):
        print(f"error: {' '.join(message.split())}", file=sys.stderr)
        raise SystemExit(2)


def parser(prog: str = "positronic smartkv") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train per-layer gates from the model's own attention")
    t.add_argument("--model", default="smollm2", help="model name (positronic.models.load_model), default smollm2")
    t.add_argument("--text", action="append", type=Path, required=True,
                   help="a training text (repeat for several; a pipe is read like a file)")
    t.add_argument("--heldout", type=Path, required=True, help="a text not trained on: Spearman is measured on it")
    t.add_argument("--out", type=Path, required=True, help="where to write the gates (.safetensors)")
    t.add_argument("--shared-out", type=Path,
                   help="also train one gate shared by all layers and write it here (.safetensors)")
    t.add_argument("--max-tokens", type=int, help="read at most this many tokens of each text (>= --window - 1)")
    # the rule's defaults are filled in below: None tells an option given from one left out
    t.add_argument("--horizon", type=int, help=f"later steps a lifespan counts (default {LifespanRule.horizon})")
    t.add_argument("--threshold", type=float,
                   help=f"a token is used when attention > threshold / visible rows; 0 < threshold < --window "
                        f"(default {LifespanRule.threshold:g})")
    t.add_argument("--window", type=int,
                   help=f"tokens per labelling prefill, at least --horizon + 2 (default {LifespanRule.window})")
    t.add_argument("--hidden", type=int, default=TrainConfig.hidden, help=f"MLP width (default {TrainConfig.hidden})")
    t.add_argument("--depth", type=int, default=TrainConfig.depth,
                   help=f"linear layers per MLP (default {TrainConfig.depth})")
    t.add_argument("--epochs", type=int, default=TrainConfig.epochs, help=f"at least 1 (default {TrainConfig.epochs})")
    t.add_argument("--batch", type=int, default=TrainConfig.batch, help=f"at least 1 (default {TrainConfig.batch})")
    t.add_argument("--lr", type=float, default=TrainConfig.lr,
                   help=f"a finite learning rate > 0 (default {TrainConfig.lr:g}); a run that diverges writes nothing")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    t.add_argument("--per-head", action="store_true",
                   help="a lifespan and a gate output per kv head, not per layer: SmartKVCache and the brain's "
                        "--policy smartkv then keep rows per kv head")
    t.add_argument("--save-labels", type=Path, help="also write the training labels here (safetensors)")
    t.add_argument("--labels", type=Path, help="reuse training labels written by --save-labels (skips labelling; "
                                               "their lifespan rule comes with them)")
    return p


def _flagged(message: str) -> str:
    """A setting's message with its leading field name written as the flag ("lr must be" ->
    "--lr must be")."""
    field = message.split(" ", 1)[0]
    return f"--{field}{message[len(field):]}" if field in SETTINGS else message


def check_options(args) -> tuple[LifespanRule, TrainConfig]:
    """The rule and the training config of the options, every option checked (ValueError, or
    the CLI's UserError, naming it), before anything is read or loaded."""
    from ..cli.common import MAX_THREADS, writable_directory

    if args.labels is not None:
        given = [f"--{name}" for name in RULE if getattr(args, name) is not None]
        if args.save_labels is not None:
            given.append("--save-labels")
        if given:
            raise ValueError(f"--labels brings the labels and the lifespan rule they were made with: leave out "
                             f"{', '.join(given)}")
    default = LifespanRule()
    rule = {name: getattr(default if getattr(args, name) is None else args, name) for name in RULE}
    check_rule(**rule)
    config = TrainConfig(hidden=args.hidden, depth=args.depth, epochs=args.epochs, batch=args.batch, lr=args.lr,
                         seed=args.seed)
    config.check()
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        raise ValueError(f"--threads must be in 1..{MAX_THREADS}, got {args.threads}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    for flag, path in (("--out", args.out), ("--shared-out", args.shared_out), ("--save-labels", args.save_labels)):
        if path is None:
            continue
        if flag != "--save-labels" and path.suffix != ".safetensors":
            raise ValueError(f"{flag} {path} must end in .safetensors (gates are stored only as safetensors)")
        if path.exists() and not path.is_file():  # a FIFO would block the write, a device swallow it
            raise ValueError(f"{flag} {path} exists and is not a regular file")
        writable_directory(path.parent, flag)
    return LifespanRule(**rule), config


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from rich.console import Console

    from ..cli.common import UserError
    from ..models import ModelError

    err = Console(stderr=True)
    try:
        try:
            rule, config = check_options(args)
        except ValueError as exc:
            raise ValueError(_flagged(str(exc))) from None
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        report = run(model=args.model, texts=args.text, heldout=args.heldout, out=args.out,
                     shared_out=args.shared_out, rule=rule, config=config, max_tokens=args.max_tokens,
                     save_labels=args.save_labels, labels=args.labels, per_head=args.per_head, console=err)
    except (OSError, ValueError, ModelError, UserError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Console(file=sys.stdout, width=100).print(report_table(report, args.heldout.name))
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB, {report.gates.parameter_count():,} parameters)"
          + (f" and {args.shared_out}" if args.shared_out else "") + f" in {report.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
