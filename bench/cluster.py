"""The server on Ray Serve (`serve --replicas 2`) against the plain server: what the front costs
one client, and whether every request reaches its session's replica.

    python bench/cluster.py [--model random:tiny] [--rounds 3] [--requests 20] [--max-tokens 32]
                            [--sessions 8] [--affinity-requests 200] [SERVE FLAGS ...]

Starts both servers (python run.py serve, and the same with --replicas 2) on free ports, each on
a temporary session directory, with the same flags (any this script does not know go to both:
`--budget 96 -t 1`). Then:

  overhead   one client, one session per round, `--requests` requests one after another, each
             generating `--max-tokens` tokens to the end (ignore_eos), whole and streamed in turn;
             rounds alternate between the two servers (plain, cluster, plain, ...), so a drift
             of the machine's speed reaches both. Generated tokens/s over each round's wall
             time; the cluster's against the plain server's, round by round and their median
             (the issue's target: at least 0.9x).
  affinity   `--sessions` sessions, `--affinity-requests` requests in all, sent by one client
             per session at once; each answer's X-Positronic-Replica header against the
             replica its session was first served by, and each replica's own /metrics (the
             sessions in its memory) against those headers.

Both servers run for the whole script: the plain server's rounds run beside the idle cluster's
processes (Ray's, each replica's), as the cluster's beside the idle plain server. Prints a
table; the exit status is 1 if a request failed or a request reached another replica than its
session's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_load import Server  # noqa: E402

REPLICA = "x-positronic-replica"


def one_client(url: str, model: str, session: str, requests: int, max_tokens: int) -> float:
    """Generated tokens/s of one client's requests, one after another (whole and streamed in turn)."""
    generated, start = 0, time.perf_counter()
    with httpx.Client(timeout=300) as client:
        for number in range(requests):
            body = {"model": model, "user": session, "prompt": f" request {number}:", "max_tokens": max_tokens,
                    "ignore_eos": True}
            if number % 2 == 0:
                answer = client.post(f"{url}/v1/completions", json=body)
                answer.raise_for_status()
                generated += answer.json()["usage"]["completion_tokens"]
                continue
            with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True,
                                                                       "stream_options": {"include_usage": True}}) as answer:
                answer.raise_for_status()
                for line in answer.iter_lines():
                    if line.startswith("data: {") and '"usage"' in line and '"completion_tokens"' in line:
                        generated += int(re.search(r'"completion_tokens":\s*(\d+)', line).group(1))
    return generated / (time.perf_counter() - start)


async def affinity(url: str, model: str, sessions: int, requests: int) -> tuple[int, int, dict[str, str], int]:
    """(requests answered, requests answered by their session's first replica, each session's replica, failures)."""
    first: dict[str, str] = {}
    answered = kept = failures = 0

    async def session(sid: str, count: int) -> None:
        nonlocal answered, kept, failures
        async with httpx.AsyncClient(timeout=300) as client:
            for number in range(count):
                body = {"model": model, "user": sid, "prompt": f" {sid} {number}", "max_tokens": 4, "ignore_eos": True}
                answer = await client.post(f"{url}/v1/completions", json=body)
                if answer.status_code != 200:
                    failures += 1
                    continue
                replica = first.setdefault(sid, answer.headers[REPLICA])
                answered += 1
                kept += answer.headers[REPLICA] == replica

    names = [f"affinity-{k}" for k in range(sessions)]
    await asyncio.gather(*(session(sid, requests // sessions + (k < requests % sessions))
                           for k, sid in enumerate(names)))
    return answered, kept, first, failures


def held_by_replicas(url: str) -> dict[str, set[str]]:
    """Each replica's sessions in memory, read from its own /metrics."""
    replicas = httpx.get(f"{url}/health", timeout=30).json()["replicas"]
    return {name: set(re.findall(r'positronic_live_length\{session="([^"]+)"\}',
                                 httpx.get(f"{entry['url']}/metrics", timeout=30).text))
            for name, entry in replicas.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--affinity-requests", type=int, default=200)
    parser.add_argument("--startup-timeout", type=float, default=300)
    args, serve_flags = parser.parse_known_args(argv)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as plain_dir, tempfile.TemporaryDirectory() as cluster_dir:
        plain = Server(args.model, plain_dir, serve_flags, args.startup_timeout)
        cluster = Server(args.model, cluster_dir, [*serve_flags, "--replicas", "2"], args.startup_timeout)
        try:
            plain.start()
            cluster.start()
            rows = []
            for round_ in range(args.rounds):
                speeds = {name: one_client(server.url, args.model, f"overhead-{name}-{round_}", args.requests,
                                           args.max_tokens) for name, server in (("plain", plain), ("cluster", cluster))}
                rows.append(speeds)
                print(f"round {round_ + 1}: plain {speeds['plain']:.1f} tok/s, cluster {speeds['cluster']:.1f} "
                      f"({speeds['cluster'] / speeds['plain']:.3f}x)", flush=True)
            answered, kept, first, failures = asyncio.run(affinity(cluster.url, args.model, args.sessions,
                                                                   args.affinity_requests))
            held = held_by_replicas(cluster.url)
        finally:
            cluster.stop()
            plain.stop()
    strays = [(sid, name) for name, sids in held.items() for sid in sids if sid in first and first[sid] != name]
    ratios = [row["cluster"] / row["plain"] for row in rows]
    spread = {name: sum(1 for replica in first.values() if replica == name) for name in sorted(held)}
    print(f"\n{args.model}, serve flags {' '.join(serve_flags) or '(none)'}, load before {load[0]:.2f}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| measurement | figure |\n|---|---|")
    print(f"| one client, plain server, tok/s (median of {args.rounds}) | "
          f"{statistics.median(r['plain'] for r in rows):.1f} |")
    print(f"| one client through the cluster (2 replicas), tok/s | {statistics.median(r['cluster'] for r in rows):.1f} |")
    print(f"| cluster / plain, by round; median | {' / '.join(f'{r:.3f}' for r in ratios)}; "
          f"**{statistics.median(ratios):.3f}x** |")
    print(f"| affinity: requests answered by their session's replica | **{kept} of {answered}** "
          f"({args.sessions} sessions; {failures} failed) |")
    print(f"| sessions per replica | {', '.join(f'{name}: {n}' for name, n in spread.items())} |")
    print(f"| replicas' own metrics: sessions held by another replica than their requests' | {len(strays)} |")
    return 1 if failures or kept != answered or strays else 0


if __name__ == "__main__":
    sys.exit(main())
