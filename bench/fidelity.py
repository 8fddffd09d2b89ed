"""What splicing costs in fidelity, and what a refresh buys back.

    python bench/fidelity.py [--model smollm2] [--budget 128] [--ticks 600] [--every 50]

Runs the brain (seeded sampling) and, every --every ticks, measures KL(fresh ‖ spliced) in
nats of the next-token distribution: the spliced live cache against a cache rebuilt from the
same live tokens at the same positions. One column per setting: no refresh, and a periodic
refresh (--refresh-every). Also prints the cost of one refresh (a prefill of the budget).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic import load_model  # noqa: E402
from positronic.brain.loop import Brain, BrainConfig  # noqa: E402

PROMPT = "The expedition left the harbour at dawn. Every member of the crew knew the map by heart, but"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--ticks", type=int, default=600)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--refresh-every", type=int, default=100)
    args = parser.parse_args()
    lm = load_model(args.model)
    ids = [lm.bos_id] + lm.encode(PROMPT)
    settings = {"no refresh": 0, f"refresh every {args.refresh_every}": args.refresh_every}
    brains = {name: Brain.start(lm, ids, BrainConfig(budget=args.budget, seed=1, refresh_every=n))
              for name, n in settings.items()}
    print(f"model {lm.name}  budget {args.budget}  KL(fresh || spliced) in nats, measured every {args.every} ticks "
          f"({time.strftime('%Y-%m-%d')})")
    print(f"{'tick':>6} " + " ".join(f"{name:>20}" for name in settings) + f" {'repairs so far':>15}")
    for tick in range(1, args.ticks + 1):
        for brain in brains.values():
            brain.step()
        if tick % args.every == 0:
            row = [brain.state.divergence() for brain in brains.values()]
            repairs = next(iter(brains.values())).counts["repairs"]
            print(f"{tick:>6} " + " ".join(f"{kl:>20.4f}" for kl in row) + f" {repairs:>15}", flush=True)
    state = next(iter(brains.values())).state
    start = time.perf_counter()
    state.rebuild()
    print(f"one refresh (prefill of {len(state)} rows): {(time.perf_counter() - start) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
