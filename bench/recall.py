"""The retrieval probe at one budget: does a fact survive --filler tokens of text?

    python bench/recall.py [TEXT ...] [--model smollm2] [--budget 256] [--filler 2000] [--at 0.05]
                           [--policies streaming scored h2o brightness brightness+recall] [--device cuda]

Per text file (default: texts/alice_ch1-2.txt) it builds `positronic eval`'s probe
(evaluate.probe_stream: BOS, the first --at of the filler, "The secret code is 4817. ...", the
rest of the filler, the question; the answer "4817" teacher-forced), runs it through the full
cache and each policy at --budget (a name with +recall runs with BrainConfig.recall on, one with
+recent with smartkv's memory ranked by recent use too: smartkv+recall+recent),
and prints per run the answer's NLL in nats (sum over its tokens), Δ against the full cache
(the target: within 1 nat), the answer tokens' ranks, recalled (every rank 1) and ms
per token of the probe stream.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic import load_model  # noqa: E402
from positronic.evaluate import (DEFAULT_TEXT, EvalError, make_config, probe_stream, read_text,  # noqa: E402
                                 reference_config, run_probe)
from positronic.models import ModelError  # noqa: E402

POLICIES = ("streaming", "scored", "h2o", "brightness", "brightness+recall")


def row(name: str, probe, seconds: float, tokens: int) -> str:
    delta = "-" if probe.delta is None else f"{probe.delta:+.2f}"
    return (f"{name:<20} {probe.nll:>10.2f} {delta:>10} {' '.join(map(str, probe.ranks)):>16} "
            f"{'yes' if probe.recalled else 'no':>8} {1000 * seconds / tokens:>8.1f}")


def policy_config(name: str, budget: int, sinks: int):
    """A --policies name's config: POLICY, then +recall and/or +recent (EvalError for another mark)."""
    policy, *marks = name.split("+")
    if unknown := sorted(set(marks) - {"recall", "recent"}):
        raise EvalError(f"policy {name!r}: unknown mark {'+'.join(unknown)} (POLICY[+recall][+recent])")
    return make_config(policy, budget, sinks=sinks, recall="recall" in marks,
                       memory_rank="recent" if "recent" in marks else "gates")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("texts", nargs="*", type=Path, default=[DEFAULT_TEXT], help="text files for the filler")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--filler", type=int, default=2000, help="filler tokens (before and after the fact)")
    parser.add_argument("--at", type=float, default=0.05, help="fraction of the filler before the fact")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the full cache's run (its answer NLL does not depend on the policies; Δ is then not shown)")
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    args = parser.parse_args(argv)
    try:
        configs = {name: policy_config(name, args.budget, args.sinks) for name in args.policies}
        lm = load_model(args.model, device=args.device, dtype=args.dtype)
        for path in args.texts:
            body, title = read_text(path)
            probe = probe_stream(lm, lm.encode(body), args.filler, args.at, keep=max(args.sinks, 1))
            tokens = len(probe.ids) - 1
            print(f"\n{lm.name} · {title} · budget {args.budget} · filler {args.filler} · fact at stream index "
                  f"{probe.fact_at} ({args.at:.0%} of the filler) · answer at {probe.answer_at}")
            print(f"{'policy':<20} {'answer NLL':>10} {'Δ vs full':>10} {'ranks':>16} {'recalled':>8} {'ms/tok':>8}")
            full = None
            if not args.no_reference:
                full, stream = run_probe(lm, probe, reference_config(len(probe.ids), sinks=args.sinks))
                full.compare(full)
                print(row("full", full, stream.seconds, tokens), flush=True)
            for name, config in configs.items():
                result, stream = run_probe(lm, probe, config)
                if result is None:  # `none` with at_capacity stop ended before the answer
                    print(f"{name:<20} {'stopped':>10}", flush=True)
                    continue
                result.compare(full)
                print(row(name, result, stream.seconds, tokens), flush=True)
    except (EvalError, ModelError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
