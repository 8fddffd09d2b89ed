"""`positronic smartkv train ...` (also `python -m positronic.smartkv train ...`): label texts, train the gates, report held-out Spearman.

    positronic smartkv train --model smollm2 --text texts/alice_ch1-2.txt \
        --heldout /work/heldout/tale_of_two_cities.txt --out gates.safetensors

Errors print one `error: ...` line and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .labels import LifespanRule
from .train import TrainConfig, report_table, run


def parser(prog: str = "positronic smartkv") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train per-layer gates from the model's own attention")
    t.add_argument("--model", default="smollm2", help="model name (positronic.models.load_model), default smollm2")
    t.add_argument("--text", action="append", type=Path, required=True,
                   help="a training text (repeat for several)")
    t.add_argument("--heldout", type=Path, required=True, help="a text not trained on: Spearman is measured on it")
    t.add_argument("--out", type=Path, required=True, help="where to write the gates (.safetensors)")
    t.add_argument("--shared-out", type=Path, help="also train one gate shared by all layers and write it here")
    t.add_argument("--max-tokens", type=int, help="read at most this many tokens of each text")
    t.add_argument("--horizon", type=int, default=LifespanRule.horizon, help="later steps a lifespan counts (default 512)")
    t.add_argument("--threshold", type=float, default=LifespanRule.threshold,
                   help="a token is used when attention > threshold / visible rows (default 2)")
    t.add_argument("--window", type=int, default=LifespanRule.window, help="tokens per labelling prefill (default 1024)")
    t.add_argument("--hidden", type=int, default=TrainConfig.hidden, help=f"MLP width (default {TrainConfig.hidden})")
    t.add_argument("--depth", type=int, default=TrainConfig.depth,
                   help=f"linear layers per MLP (default {TrainConfig.depth})")
    t.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    t.add_argument("--batch", type=int, default=TrainConfig.batch)
    t.add_argument("--lr", type=float, default=TrainConfig.lr)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    t.add_argument("--per-head", action="store_true",
                   help="a lifespan and a gate output per kv head, not per layer: SmartKVCache and the brain's "
                        "--policy smartkv then keep rows per kv head")
    t.add_argument("--save-labels", type=Path, help="also write the training labels here (safetensors)")
    t.add_argument("--labels", type=Path, help="reuse training labels written by --save-labels (skips labelling)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from rich.console import Console

    from ..models import ModelError

    err = Console(stderr=True)
    try:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        rule = LifespanRule(horizon=args.horizon, threshold=args.threshold, window=args.window)
        config = TrainConfig(hidden=args.hidden, depth=args.depth, epochs=args.epochs, batch=args.batch,
                             lr=args.lr, seed=args.seed)
        if args.out.suffix != ".safetensors":
            raise ValueError(f"--out {args.out} must end in .safetensors (gates are stored only as safetensors)")
        report = run(model=args.model, texts=args.text, heldout=args.heldout, out=args.out,
                     shared_out=args.shared_out, rule=rule, config=config, max_tokens=args.max_tokens,
                     save_labels=args.save_labels, labels=args.labels, per_head=args.per_head, console=err)
    except (OSError, ValueError, ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Console(file=sys.stdout, width=100).print(report_table(report, args.heldout.name))
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB, {report.gates.parameter_count():,} parameters)"
          + (f" and {args.shared_out}" if args.shared_out else "") + f" in {report.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
