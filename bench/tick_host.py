"""Where a tick's time goes outside the model forward: the host's part of a brain's tick.

    python bench/tick_host.py [--model smollm2] [--policies streaming smartkv+recall]
                              [--budget 256] [--ticks 200] [--rounds 3] [--device cpu]
                              [--profile 25]

In a batch (positronic.batch, the server) the forward is shared and each sequence's tick
outside it is what B sequences add one after another, so this part bounds what batching
gains. For each policy, one brain ticks twice over:
  under   from a 30-token prompt, staying under its budget (a chat's first turns: nothing is
          evicted, recall has nothing to look at);
  past    from a prompt of budget + 32 tokens, `--warm` ticks in (default 300; every tick
          evicts, recall looks).
It prints ms a tick in all, in the model forward (`state.forward.forward_alone`), and
outside it, medians over the rounds. On a GPU the forward's time ends with a synchronize,
so the host's part is what the tick does after its kernels ran, and the table adds how many
calls a tick waited on the GPU for (torch's sync debug mode, counted), then each line of
Python that waited and how often. `--profile N`: the N
functions of this project with the most own time outside the forward (cProfile, one more
round each).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import batch  # noqa: E402  (bench/batch.py: its prompts and policy settings)
from positronic.brain.loop import Brain, BrainConfig  # noqa: E402
from positronic.models import ModelError, load_model  # noqa: E402
from positronic.policies import POLICIES  # noqa: E402
from positronic.smartkv.gates import bench_gates  # noqa: E402
from positronic.state import forward as forward_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOST = tuple(str(ROOT / part) for part in ("positronic", "mirror", "steps"))  # the project's code...
MODEL = str(ROOT / "positronic" / "models")  # ...but the model's modules (inside the forward)


class ForwardClock:
    """Times every `forward_alone` (the model forward of a brain ticking alone), ending with
    a synchronize on a GPU."""

    def __init__(self, device: str):
        self.device, self.seconds, self.calls = device, 0.0, 0
        self.inner = forward_module.forward_alone

    def __enter__(self) -> "ForwardClock":
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                if self.device.startswith("cuda"):
                    torch.cuda.synchronize()
                self.seconds += time.perf_counter() - start
                self.calls += 1

        forward_module.forward_alone = timed
        return self

    def __exit__(self, *exc) -> None:
        forward_module.forward_alone = self.inner


def brain(lm, config: dict, budget: int, past: bool, seed: int, warm: int) -> Brain:
    ids = lm.encode(batch.TEXT)
    prompt = [lm.bos_id] + ids[: budget + 32 if past else 30]
    made = Brain.start(lm, prompt, BrainConfig(**config, seed=seed))
    for _ in range(warm if past else 10):
        made.step()
    return made


def syncs_per_tick(made: Brain, ticks: int) -> tuple[float, Counter] | None:
    """GPU waits a tick makes (torch's sync debug mode warns at each), and how many of them
    each line makes (the Python line that made the call that waited), None on a CPU."""
    if made.state.lm.device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(ticks):
                made.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = [w for w in caught if "synchroniz" in str(w.message)]
    sites = Counter(f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(str(ROOT)) else w.filename}"
                    f":{w.lineno}" for w in waits)
    return len(waits) / ticks, sites


def measure(lm, config: dict, budget: int, past: bool, ticks: int, rounds: int, device: str, warm: int) -> dict:
    totals, forwards = [], []
    for round_ in range(rounds):
        made = brain(lm, config, budget, past, seed=round_, warm=warm)
        with ForwardClock(device) as clock:
            start = time.perf_counter()
            for _ in range(ticks):
                made.step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            totals.append((time.perf_counter() - start) / ticks)
            forwards.append(clock.seconds / ticks)
    outside = [total - forward for total, forward in zip(totals, forwards)]
    return {"total": statistics.median(totals), "forward": statistics.median(forwards),
            "outside": statistics.median(outside), "spread": (min(outside), max(outside)),
            "syncs": syncs_per_tick(made, min(ticks, 20)), "ticks": min(ticks, 20)}


def profile(lm, policy: str, config: dict, budget: int, past: bool, ticks: int, top: int, warm: int) -> None:
    made = brain(lm, config, budget, past, seed=0, warm=warm)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(ticks):
        made.step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        if path.startswith(HOST) and not path.startswith(MODEL):
            rows.append((own, calls, cumulative, f"{os.path.relpath(path, ROOT)}:{line}({name})"))
    print(f"\n{policy}, {'past' if past else 'under'} the budget: own time per tick of the project's functions "
          f"but the model's modules (cProfile, {ticks} ticks)")
    print(f"{'own ms':>8} {'cum ms':>8} {'calls':>7}  function")
    for own, calls, cumulative, name in sorted(rows, reverse=True)[:top]:
        print(f"{own / ticks * 1e3:8.3f} {cumulative / ticks * 1e3:8.3f} {calls / ticks:7.1f}  {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float16 on cuda, float32 on cpu")
    parser.add_argument("--policies", nargs="+", default=["streaming", "smartkv+recall"])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=300,
                        help="ticks the past run makes before it is timed (recall's index fills meanwhile)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (a batch's sequences keep to 1)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="also print the N costliest functions")
    args = parser.parse_args(argv)
    if args.ticks < 1 or args.rounds < 1 or args.budget < 40 or args.threads < 1 or args.profile < 0 or args.warm < 0:
        parser.error("--ticks, --rounds and --threads must be >= 1, --budget >= 40 (the under run's prompt is 30 "
                     "tokens), --profile and --warm >= 0")
    for policy in args.policies:
        name, plus, extra = policy.partition("+")
        if name not in POLICIES or plus and extra != "recall":
            parser.error(f"--policies {policy}: a policy is one of {', '.join(sorted(POLICIES))}, with +recall or "
                         "without")
    torch.set_num_threads(args.threads)
    try:
        lm = load_model(args.model, device=args.device, dtype=args.dtype)
    except (ModelError, ValueError) as error:
        parser.error(str(error))
    folder = tempfile.TemporaryDirectory()
    _, gates = bench_gates(lm, folder.name)  # a random model's smartkv: untrained gates, which cost what trained ones do
    configs = {policy: batch.configs(policy, args.budget, gates) for policy in args.policies}
    print(f"model {args.model}  {lm.device}  {str(lm.dtype).removeprefix('torch.')}  budget {args.budget}  "
          f"{args.ticks} ticks x {args.rounds} rounds  torch {torch.__version__} threads {torch.get_num_threads()}  "
          f"load {os.getloadavg()[0]:.2f}  {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'policy':<16} {'run':<6} {'tick ms':>8} {'forward':>8} {'outside':>8} {'share':>6} {'outside range':>15}"
          f" {'GPU waits':>9}")
    sites = {}
    for policy in args.policies:
        for past in (False, True):
            got = measure(lm, configs[policy], args.budget, past, args.ticks, args.rounds, str(lm.device), args.warm)
            low, high = got["spread"]
            waits = f"{'-':>9}" if got["syncs"] is None else f"{got['syncs'][0]:9.1f}"
            if got["syncs"] is not None:
                sites[policy, past] = got["syncs"][1], got["ticks"]
            print(f"{policy:<16} {'past' if past else 'under':<6} {got['total'] * 1e3:8.2f} {got['forward'] * 1e3:8.2f} "
                  f"{got['outside'] * 1e3:8.2f} {got['outside'] / got['total']:6.1%} "
                  f"{f'{low * 1e3:.2f}-{high * 1e3:.2f}':>15} {waits}", flush=True)
    for (policy, past), (where, ticks) in sites.items():
        print(f"\n{policy}, {'past' if past else 'under'} the budget: GPU waits per tick by the line that waited")
        for site, count in where.most_common():
            print(f"{count / ticks:6.2f}  {site}")
    if args.profile:
        for policy in args.policies:
            for past in (False, True):
                profile(lm, policy, configs[policy], args.budget, past, args.ticks, args.profile, args.warm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
