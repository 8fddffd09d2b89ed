"""A prototype, not the product's path: SmartKV's memory ranked by the gates *and* by the
attention each lane has been paying its rows lately. It patches the brain's SmartKV policy
while it runs, then runs another bench script unchanged:

    python bench/observed_rank.py [--beta 2] [--decay 0.97] [--offset 1] -- smartkv --text FILE --methods smartkv+recall
    python bench/observed_rank.py -- recall FILE --policies smartkv+recall

**The rank.** SmartKV ranks a lane's memory by `4 ** score * (1 - age / horizon)`: the uses
the gate predicts are still ahead, times what a use adds (docs/smartkv.md). Here it is
multiplied by `(offset + observed) ** beta`, where `observed` is the lane's recent attention to
the row: after every forward, the newest query's attention to each row of the lane (the
largest over the query heads that share the lane's kv head, times the lane's row count, so
that 1 is a uniform share) is added to a sum that decays by `decay` a tick (0.97: about the
last 32 ticks). A row no query looked at lately keeps its gate rank (offset 1, observed 0);
one in use ranks higher. Measured offline first (labels.py's rule on Dracula, kv heads of
SmolLM2): for memory rows at ages 160 and 256, the rank correlation with uses in the next 64
ticks is 0.61 and 0.55 for the gates alone, 0.64 and 0.56 for the recent attention alone, 0.66
and 0.58 for the two together.

**What the prototype does not do** (the product version must): it copies every lane's keys and
row ids after the forward through the view (`RowReader.lane_keys`, `lane_ids`) to get the
attention (about 1.5 ms a tick on the 2-core CPU), keeps the sums in a table by ledger id that
grows with the run, and nothing of it is saved with a session or used by SmartKVCache, so
`smartkv-brain` no longer matches `smartkv` under it. Results: bench/results/history/smartkv.md.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from positronic.smartkv import policy as smartkv_policy  # noqa: E402
from positronic.smartkv import rows as smartkv_rows  # noqa: E402

SCRIPTS = {"smartkv": ROOT / "bench" / "smartkv.py", "recall": ROOT / "bench" / "recall.py"}


class Observed:
    """The decayed attention sums of one policy: [lanes, ledger ids] (a dense table)."""

    current: "Observed | None" = None  # the policy whose tick is being planned (Memories reads it)

    def __init__(self, decay: float):
        self.decay = decay
        self.table: np.ndarray | None = None

    def add(self, view) -> None:
        """The newest query's attention to each row of each lane, added to the decayed sums."""
        if view.query is None or view.log_norm is None:
            return
        keys = view.rows.lane_keys()  # [layers, kv, rows, d]
        layers, kv_heads, rows, head_dim = keys.shape
        query = view.query.float().reshape(layers, kv_heads, -1, head_dim)
        logits = query @ keys.transpose(-1, -2)  # [layers, kv, group, rows]
        share = torch.exp(logits - view.log_norm.float().reshape(layers, kv_heads, -1, 1)).amax(2)
        mass = (share * rows).reshape(layers * kv_heads, rows).numpy()
        ids = np.array(view.rows.lane_ids(), dtype=np.int64)  # [lanes, rows]: each lane's ledger ids
        need = int(ids.max()) + 1
        if self.table is None or self.table.shape[1] < need:
            grown = np.zeros((ids.shape[0], max(2 * need, 2048)))
            if self.table is not None:
                grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        lane = np.arange(ids.shape[0])[:, None]
        self.table[lane, ids] = self.decay * self.table[lane, ids] + mass

    def of(self, lanes, ids: np.ndarray) -> np.ndarray:
        return np.zeros(ids.shape) if self.table is None else self.table[lanes, np.minimum(ids, self.table.shape[1] - 1)]


PROTECTED = 1e250  # above every rank the factor can make, below HELD


def patch(beta: float, decay: float, offset: float, seed_restored: bool, cap: float = float("inf"),
          protect: float = 0.0, span: int = 0, fresh: bool = False, fresh_back: bool = False) -> None:
    if span:  # tokens one recall brings back around its match, whatever the memory's size
        smartkv_policy.SmartKVPolicy.recall_span = staticmethod(lambda memory: span)
    ranks_before, plan_before = smartkv_rows.Memories._ranks, smartkv_policy.SmartKVPolicy._plan
    take_back_before = smartkv_rows.Memories.take_back
    offer_before = smartkv_rows.Memories.offer

    def offer(self, token_id, position, scores, now):
        observed = Observed.current
        if fresh and observed is not None and observed.table is not None and np.ndim(token_id) == 0 \
                and token_id < observed.table.shape[1]:
            observed.table[:, token_id] = 0.0  # it enters the memory with no recent use counted
        return offer_before(self, token_id, position, scores, now)

    def take_back(self, layer, token_ids, scores, now, hold=0):
        dropped = take_back_before(self, layer, token_ids, scores, now, hold)
        observed = Observed.current
        if (fresh or fresh_back) and observed is not None and observed.table is not None:
            for token_id in token_ids:  # back in the lane's memory: no recent use counted yet
                if token_id < observed.table.shape[1]:
                    observed.table[layer, token_id] = 0.0
        if seed_restored and observed is not None and observed.table is not None:
            # recall brought it back because a query wanted it: it starts as the lane's most observed row
            held = self.ids[layer, : self.count]
            top = float(observed.of(layer, held).max()) if len(held) else 0.0
            for token_id in token_ids:
                if token_id < observed.table.shape[1]:
                    observed.table[layer, token_id] = top
        return dropped

    def ranks(self, now, slots, layers=slice(None)):
        ranks = ranks_before(self, now, slots, layers)
        observed = Observed.current
        if observed is None:
            return ranks
        lanes = np.arange(self.ids.shape[0])[layers]
        seen = observed.of(lanes if np.ndim(lanes) == 0 else lanes[:, None], self.ids[layers, slots])
        boosted = ranks * np.minimum((offset + seen) ** beta, cap)
        if protect > 0:  # the gates' own top share of each lane is never outranked by recent use
            n = ranks.shape[-1]
            k = n - max(1, int(round(protect * n)))
            top = np.partition(ranks, k, axis=-1)[..., k : k + 1]
            boosted = np.where(ranks >= top, PROTECTED, boosted)
        return np.where(ranks >= smartkv_rows.HELD, ranks, boosted)

    def plan(self, view, seconds, *, look, typed=False):
        if not hasattr(self, "observed"):
            self.observed = Observed(decay)
        Observed.current = self.observed
        if look:
            self.observed.add(view)
        return plan_before(self, view, seconds, look=look, typed=typed)

    smartkv_rows.Memories._ranks = ranks
    smartkv_rows.Memories.take_back = take_back
    smartkv_rows.Memories.offer = offer
    smartkv_policy.SmartKVPolicy._plan = plan


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: observed_rank.py [--beta B] [--decay D] [--offset C] -- {smartkv,recall} ARGS ...")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--beta", type=float, default=2.0, help="the power of (offset + observed) in the rank")
    parser.add_argument("--decay", type=float, default=0.97, help="the sums' decay per tick (0.97: ~32 ticks)")
    parser.add_argument("--offset", type=float, default=1.0, help="added to the sum: a row never looked at keeps its rank")
    parser.add_argument("--cap", type=float, default=float("inf"),
                        help="the factor's largest value (default: none): recent use cannot outrank the gates' picks by more")
    parser.add_argument("--protect", type=float, default=0.0,
                        help="the share of each lane's memory the gates alone rank highest, kept whatever recent use says")
    parser.add_argument("--span", type=int, default=0,
                        help="tokens one recall brings back around its match (default: the policy's, min(16, memory / 8))")
    parser.add_argument("--fresh", action="store_true",
                        help="a token entering a lane's memory (from the window, or taken back by recall) starts with no recent use counted")
    parser.add_argument("--fresh-back", action="store_true",
                        help="a token recall takes back starts with no recent use counted (else its sum when it left)")
    parser.add_argument("--seed-restored", action="store_true",
                        help="a token recall brings back starts with its lane's largest sum (else its old one)")
    args = parser.parse_args(argv[:split])
    rest = argv[split + 1:]
    if not rest or rest[0] not in SCRIPTS:
        raise SystemExit(f"name the script to run after --: one of {', '.join(SCRIPTS)}")
    if not (args.beta >= 0 and 0 < args.decay < 1 and args.offset > 0 and args.cap >= 1 and 0 <= args.protect < 1 and args.span >= 0):
        raise SystemExit("--beta must be >= 0, --decay in (0, 1), --offset > 0, --cap >= 1, --protect in [0, 1), --span >= 0")
    patch(args.beta, args.decay, args.offset, args.seed_restored, args.cap, args.protect, args.span, args.fresh, args.fresh_back)
    print(f"# observed rank (prototype): beta {args.beta}  decay {args.decay}  offset {args.offset}"
          f"{'  restored tokens seeded' if args.seed_restored else ''}{f'  cap {args.cap}' if args.cap < float('inf') else ''}"
          f"{f'  protect {args.protect}' if args.protect else ''}{f'  span {args.span}' if args.span else ''}"
          f"{'  fresh' if args.fresh else ''}{'  fresh-back' if args.fresh_back else ''}",
          flush=True)
    sys.argv = [str(SCRIPTS[rest[0]]), *rest[1:]]
    runpy.run_path(str(SCRIPTS[rest[0]]), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
