"""The mission's own command, measured: a long run with the default policy, then its text judged
chunk by chunk.

    python bench/long_run.py [--model smollm2] [--ticks 10000] [--budget 128] [--every 1000]
                             [--context 1024] [--out bench/eval_results/long_run] [-- RUN FLAGS]

Runs `python run.py --model M --ticks N --budget B --no-tui --no-input --events OUT/events.jsonl`
(the default policy and sampling, as a user gets them), then per chunk of `--every` ticks:
the re-scored perplexity of the chunk's tokens under the plain model given the `--context`
tokens before them (nothing evicted: is the text what the model itself finds likely, and does
that drift as the run goes on), distinct-4 over the chunk's token ids (loops push it toward
0), the rebuilds (failed ticks) and the largest live length. Prints a table and writes
OUT/long_run.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from positronic.cli.run import DEFAULT_PROMPT  # noqa: E402
from positronic.evaluate.generation import distinct_n, rescore  # noqa: E402
from positronic.models import load_model  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--ticks", type=int, default=10000)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--every", type=int, default=1000, help="ticks per chunk")
    parser.add_argument("--context", type=int, default=1024, help="tokens before a chunk its re-scoring sees")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "eval_results" / "long_run")
    parser.add_argument("run_flags", nargs="*", help="more flags for run.py (after --)")
    args = parser.parse_args(argv)
    if args.every < 1 or args.ticks < args.every or args.context < 1:
        parser.error("--every must be >= 1 and <= --ticks, --context >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    events = args.out / "events.jsonl"
    command = [sys.executable, str(ROOT / "run.py"), "--model", args.model, "--ticks", str(args.ticks), "--budget",
               str(args.budget), "--no-tui", "--no-input", "--events", str(events), "--overwrite", *args.run_flags]
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    seconds = time.time() - start
    records = [json.loads(line) for line in events.read_text(encoding="utf-8").splitlines()]
    ticks = [r for r in records[1:] if r.get("record") == "tick"]
    lm = load_model(args.model)
    flags = args.run_flags
    text = next((flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag in ("-p", "--prompt")), DEFAULT_PROMPT)
    prompt = [lm.bos_id] + lm.encode(text)  # what run.py started from
    said = [r["token_id"] for r in ticks if not r["rebuilt"]]
    ids = prompt + said
    rows = []
    for k in range(0, len(ticks), args.every):
        chunk = ticks[k:k + args.every]
        first = len(prompt) + sum(1 for r in ticks[:k] if not r["rebuilt"])
        made = [r["token_id"] for r in chunk if not r["rebuilt"]]
        nll = rescore(lm, ids[max(0, first - args.context):first], made)
        rows.append({"ticks": f"{k + 1}-{k + len(chunk)}", "ppl": math.exp(sum(nll) / len(nll)),
                     "distinct4": distinct_n(made, 4), "rebuilds": sum(r["rebuilt"] for r in chunk),
                     "max_live": max(r["live_length"] for r in chunk)})
    print(f"{args.model}, budget {args.budget}, {args.ticks} ticks in {seconds:.0f} s (with the model's load), "
          f"load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(done.stderr.strip().splitlines()[0] if done.stderr.strip() else "")
    print(f"{'ticks':>13} {'re-scored ppl':>14} {'distinct-4':>11} {'rebuilds':>9} {'max live':>9}")
    for row in rows:
        print(f"{row['ticks']:>13} {row['ppl']:>14.2f} {row['distinct4']:>11.3f} {row['rebuilds']:>9} {row['max_live']:>9}")
    summary = [line for line in done.stdout.splitlines() if line.startswith(("ticks ", "live ", "repairs ", "cache "))]
    print("\n".join(summary))
    (args.out / "long_run.json").write_text(json.dumps({"command": command, "seconds": seconds, "rows": rows,
                                                        "summary": summary}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
