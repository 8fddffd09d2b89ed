"""Cost of Step 4 for a typical tick (1 add + 2 replace_pair) at several context lengths.

    python bench/step4.py [--model smollm2] [--store dynamic] [--contexts 256 512 1024 2048]

For each context it times, median over --repeats ticks:
  tick      apply([replace_pair, replace_pair, add]) — the whole Step 4 of a typical tick;
  add only  apply([add]) — the one forward every tick needs anyway;
  repairs   tick − add only: what the two replacements cost (splices + their forwards);
  splices   the store's delete/delete/insert row moves alone, for two pairs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic import StateManager, load_model  # noqa: E402


def sync(lm):
    if lm.device.type == "cuda":
        torch.cuda.synchronize()


def timed(lm, fn) -> float:
    sync(lm)
    start = time.perf_counter()
    fn()
    sync(lm)
    return time.perf_counter() - start


def bench_context(lm, store: str, context: int, repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(context)
    ids = torch.randint(3, lm.vocab_size, (context,), generator=generator).tolist()
    sm = StateManager.from_tokens(lm, [lm.bos_id] + ids[1:], store=store)
    tick, add, splice = [], [], []
    for i in range(repeats):
        n = len(sm)
        middle = n // 2 - 3 * i % (n // 4)
        actions = [
            {"action": "replace_pair", "original_pos1": middle, "original_pos2": middle + 1, "new_token_ids": [ids[i]]},
            {"action": "replace_pair", "original_pos1": middle - 40, "original_pos2": middle - 39, "new_token_ids": [ids[i + 1]]},
            {"action": "add", "token_id": ids[i + 2]},
        ]
        tick.append(timed(lm, lambda: sm.apply(actions)))
        sm.apply([{"action": "delete", "position": 10}])  # hold the length steady
        add.append(timed(lm, lambda: sm.apply([{"action": "add", "token_id": ids[i + 3]}])))
        sm.apply([{"action": "delete", "position": 10}])
        keys, values = sm.store.layer(0)
        block_k = torch.stack([sm.store.layer(l)[0][:, :, :1] for l in range(sm.store.num_layers)])
        block_v = torch.stack([sm.store.layer(l)[1][:, :, :1] for l in range(sm.store.num_layers)])

        def row_moves():
            for row in (middle, middle - 40):
                sm.store.delete(row + 1)
                sm.store.delete(row)
                sm.store.insert(row, block_k, block_v)

        splice.append(timed(lm, row_moves))
        sm.rebuild()  # the row moves above bypassed the mirror; put the cache back in step
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"tick": ms(tick), "add": ms(add), "repairs": ms(tick) - ms(add), "splices": ms(splice)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--store", default="dynamic")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    print(f"model {lm.name}  store {args.store}  device {lm.device}  dtype {str(lm.dtype).removeprefix('torch.')}  "
          f"torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"{'context':>8} {'tick ms':>9} {'add only':>9} {'repairs':>9} {'splices':>9} {'splices/tick':>13}")
    for context in args.contexts:
        r = bench_context(lm, args.store, context, args.repeats)
        print(f"{context:>8} {r['tick']:>9.2f} {r['add']:>9.2f} {r['repairs']:>9.2f} {r['splices']:>9.3f} "
              f"{r['splices'] / r['tick']:>12.1%}", flush=True)


if __name__ == "__main__":
    main()
