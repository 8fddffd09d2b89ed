"""What a session checkpoint costs as SmartKV recall's index grows: save, bytes written, resume.

    python bench/checkpoint.py [--model smollm2] [--budget 256] [--requests 3] [--tokens 32] [--warm 200]

A brain with the default policy (SmartKV with recall) runs `--warm` ticks, then checkpoints after
every `--tokens` more ticks (a server request's reply, written through before its answer
ends), `--requests` times, into one session directory. Then its index is filled to capacity
(`SmartKVPolicy.recall_capacity`: 4,096 tokens; 2,048 before 2026-12-04) and the same is
measured again: the filling tokens are made up (random K/V, ledger ids past the run's, recall
kept from bringing them back), since what a save costs depends on the sizes it writes, not on
what they hold. Prints per stage: tokens indexed, the
first save, each later save (ms), the bytes each later save wrote (files created or
rewritten), the directory's size and one resume (ms). Run it from a worktree of an older
commit to compare (both sides' `session.save` and `resume` are the same calls).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic.brain import session  # noqa: E402
from positronic.brain.loop import Brain, BrainConfig  # noqa: E402
from positronic.models import ModelError, load_model  # noqa: E402
from positronic.smartkv.gates import bench_gates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def files(directory: str) -> dict[str, tuple[int, int, int]]:
    """name -> (inode, mtime, size) of every file in `directory`."""
    return {entry.name: (entry.stat().st_ino, entry.stat().st_mtime_ns, entry.stat().st_size)
            for entry in os.scandir(directory)}


def stage(lm, brain: Brain, label: str, requests: int, tokens: int) -> None:
    directory = tempfile.mkdtemp(prefix="checkpoint-bench-")
    start = time.perf_counter()
    session.save(directory, brain, lm.name)
    first = time.perf_counter() - start
    seconds, written = [], []
    for _ in range(requests):
        for _ in range(tokens):
            brain.step()
        before = files(directory)
        start = time.perf_counter()
        session.save(directory, brain, lm.name)
        seconds.append(time.perf_counter() - start)
        written.append(sum(size for name, (*stamp, size) in files(directory).items()
                           if before.get(name, (None,))[:2] != tuple(stamp)))
    size = sum(size for *_, size in files(directory).values())
    start = time.perf_counter()
    session.resume(lm, directory)
    resume = time.perf_counter() - start
    print(f"{label:<12} {len(brain.policy.recall.ids):>7} {first * 1e3:>10.0f} {statistics.median(seconds) * 1e3:>10.0f} "
          f"{' '.join(f'{s * 1e3:.0f}' for s in seconds):>16} {statistics.median(written) / 1e6:>9.1f} "
          f"{size / 1e6:>9.1f} {resume * 1e3:>9.0f}", flush=True)


def fill(brain: Brain) -> None:
    """The index to capacity with made-up tokens (see the module docstring)."""
    recall = brain.policy.recall
    recall.share = float("inf")  # nothing comes back: the made-up tokens are not in the ledger
    count = recall.capacity - len(recall.ids)
    first = len(brain.state.mirror.ledger) + 10**6
    layers, kv_heads, head_dim = recall.keys.shape[:3]
    newest = max(recall.positions)
    recall._write(list(range(first, first + count)), [k % newest for k in range(count)], [0] * count,
                  torch.randn(layers, kv_heads, count, head_dim), torch.randn(layers, kv_heads, count, head_dim))
    recall.scores.update({i: list(next(iter(recall.scores.values()))) for i in range(first, first + count)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--requests", type=int, default=3, help="later saves per stage")
    parser.add_argument("--tokens", type=int, default=32, help="ticks between two saves (a request's reply)")
    parser.add_argument("--warm", type=int, default=200, help="ticks before the first save (the index fills)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.tokens < 1 or args.warm < 1 or args.budget < 64:
        parser.error("--requests, --tokens and --warm must be >= 1, --budget >= 64")
    try:
        lm = load_model(args.model)
    except (ModelError, ValueError) as error:
        parser.error(str(error))
    folder = tempfile.TemporaryDirectory()
    _, gates = bench_gates(lm, folder.name)  # a random model's: untrained, the same sizes
    ids = lm.encode((ROOT / "texts" / "alice_ch1-2.txt").read_text(encoding="utf-8"))
    brain = Brain.start(lm, [lm.bos_id] + ids[: args.budget + 44],
                        BrainConfig(policy="smartkv", recall=True, gates=gates, budget=args.budget, seed=1))
    for _ in range(args.warm):
        brain.step()
    print(f"model {args.model}  budget {args.budget}  a save after every {args.tokens} ticks  torch {torch.__version__} "
          f"threads {torch.get_num_threads()}  load {os.getloadavg()[0]:.2f}  {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'index':<12} {'tokens':>7} {'first ms':>10} {'later ms':>10} {'each':>16} {'wrote MB':>9} "
          f"{'dir MB':>9} {'resume ms':>9}")
    stage(lm, brain, "as it runs", args.requests, args.tokens)
    fill(brain)
    stage(lm, brain, "full", args.requests, args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
