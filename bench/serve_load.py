"""Load test of `positronic serve`: concurrent clients, each in a session of its own.

    python bench/serve_load.py [--model random:tiny] [--clients 8] [--requests 20] [--max-tokens 16]
                               [--eos] [--timeout 120] [--startup-timeout 300] [SERVE FLAGS ...]
    python bench/serve_load.py --levels 8 1 --rounds 3 [the same flags]      # client counts compared

Starts `positronic serve` itself (python run.py serve) on 127.0.0.1, on a port the system
picks, with its sessions checkpointed into a temporary directory that is removed afterwards;
any flag this script does not know is passed to serve as it is (`--budget 256 --policy h2o
-t 2`). Then `--clients` clients (the official openai client, AsyncOpenAI, one each) run at
once, each sending `--requests` requests one after another: chat completions and
completions, streamed and not, in turn (the mix is the same whatever the counts), every one
asking for `--max-tokens` tokens (generated to the end: `ignore_eos`, unless `--eos`). Even
clients name their session with the `user` field, odd ones with the X-Session-Id header;
each prompt carries a marker naming its client and request. The server is stopped (SIGTERM)
when the clients are done, or after `--timeout` seconds of a request.

Checks, after the run:
  failed requests   an exception (an HTTP error, a timeout, a broken stream), or an answer
                    without its text, finish reason or usage;
  mixed sessions    a session whose state is not exactly its client's conversation: every
                    answer must name the client's session, GET /v1/sessions/ID must count as
                    many tokens said (transcript_tokens: prompt, user and generated tokens in
                    the ledger, culled ones included) as the client's answers reported
                    (usage prompt_tokens + completion_tokens, summed), and its transcript must
                    hold the client's own markers, in order, and no other client's;
  server counters   /metrics' prompt and generated token totals equal the clients' sums.
The exit status is 1 when a request failed or a session is mixed.

It prints a table and writes nothing else: requests, failures, mixed sessions, latency
percentiles (p50/p90/p99, nearest rank; non-streamed requests: the whole request; streamed
ones: time to the first chunk with text, and the whole stream; every request, whole: the one
row that compares across client counts, as client k's request r is of kind (k + r) mod 4, so
with one client chat's are its 1st (a fresh session's prefill) and 5th), and tokens per
second over the run's wall time (generated, and prompt + generated). The header notes the machine's load (loadavg) and
torch's threads, as other work on the machine skews every figure.

`--levels 8 1 --rounds 3` compares client counts (the targets: 8 clients at >= 4x one
client's tokens/s, at <= 2x its p50): each round runs every level in turn, each on a fresh
server, so a drift of the machine's speed reaches them all; a 2-core box moves by 5-10% from
run to run. It prints a row per run
(generated tokens/s, p50 and p90 of every request whole, failures, mixed sessions, the load),
then per level the median over rounds of tokens/s and p50, the p50 (and p99) of every round's requests
pooled (one client sends only `--requests` requests a round: pooling steadies its p50), the
pooled p50 of the streamed requests' time per output token after their first text (TPOT), and
each against the fewest clients, round by round too. It exits 1 if any run had a failed
request or a mixed session (and prints that run's table).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import statistics
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("chat", "chat-stream", "completion", "completion-stream")


@dataclass
class Result:
    kind: str
    ok: bool = False
    error: str = ""
    total_s: float = 0.0
    first_s: float | None = None  # streamed: time to the first chunk with text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    session: str | None = None  # the session the answer names (the positronic extension)

    @property
    def per_token_s(self) -> float | None:
        """Streamed: time per output token after the first text (vLLM's TPOT), None otherwise."""
        if self.first_s is None or self.completion_tokens < 2:
            return None
        return (self.total_s - self.first_s) / (self.completion_tokens - 1)


@dataclass
class Client:
    index: int
    session: str
    results: list[Result] = field(default_factory=list)
    markers: list[str] = field(default_factory=list)


# -- the server ------------------------------------------------------------------------------

class Server:
    """`python run.py serve` in a subprocess on a free port; its stderr kept (its tail) for errors."""

    def __init__(self, model: str, session_dir: str, flags: list[str], startup_timeout: float):
        self.command = [sys.executable, str(ROOT / "run.py"), "serve", "-m", model, "--host", "127.0.0.1",
                        "--port", "0", "--session-dir", session_dir, *flags]
        self.startup_timeout = startup_timeout
        self.tail: deque[str] = deque(maxlen=40)
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, cwd=ROOT)
        found = threading.Event()

        def drain() -> None:  # read stderr to the end, so the server never blocks on a full pipe
            for line in self.process.stderr:
                self.tail.append(line.rstrip())
                if not found.is_set() and (match := re.search(r"running on (http://\S+)", line)):
                    self.url = match.group(1)
                    found.set()

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        while not found.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("positronic serve did not start:\n" + "\n".join(self.tail))
        while True:  # uvicorn is listening; /health says the app is up
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit("positronic serve never answered /health:\n" + "\n".join(self.tail))
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown: it checkpoints its sessions into the temporary directory)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -- the clients -----------------------------------------------------------------------------

def marker(client: int, request: int) -> str:
    return f"[c{client}r{request}]"  # brackets: [c1r1] is no part of [c1r10]


async def one_request(api: openai.AsyncOpenAI, model: str, client: Client, request: int, args,
                      history: list[dict]) -> Result:
    kind = KINDS[(client.index + request) % len(KINDS)]
    result = Result(kind)
    mark = marker(client.index, request)
    client.markers.append(mark)
    text = f"{mark} Tell me about {request}."
    session = ({"user": client.session} if client.index % 2 == 0
               else {"extra_headers": {"X-Session-Id": client.session}})
    common = dict(model=model, max_tokens=args.max_tokens, extra_body={"ignore_eos": not args.eos}, **session)
    stream = kind.endswith("stream")
    if stream:
        common.update(stream=True, stream_options={"include_usage": True})
    chat = kind.startswith("chat")
    messages = history + [{"role": "user", "content": text}]
    start = time.perf_counter()
    try:
        if chat:
            answer = await api.chat.completions.create(messages=messages, **common)
        else:
            answer = await api.completions.create(prompt=" " + text, **common)
        if stream:
            pieces, finish, usage = [], None, None
            async for chunk in answer:
                if chunk.choices:
                    choice = chunk.choices[0]
                    piece = (choice.delta.content if chat else choice.text) or ""
                    if piece and result.first_s is None:
                        result.first_s = time.perf_counter() - start
                    pieces.append(piece)
                    if choice.finish_reason is not None:
                        finish = choice.finish_reason
                        result.session = (chunk.model_extra or {}).get("positronic", {}).get("session")
                if chunk.usage is not None:
                    usage = chunk.usage
            result.total_s = time.perf_counter() - start
            reply = "".join(pieces)
            if result.first_s is None:  # no text at all (an empty reply): the stream's end
                result.first_s = result.total_s
        else:
            result.total_s = time.perf_counter() - start
            choice = answer.choices[0]
            reply, finish, usage = (choice.message.content if chat else choice.text), choice.finish_reason, answer.usage
            result.session = (answer.model_extra or {}).get("positronic", {}).get("session")
        if reply is None or finish is None or usage is None:
            raise ValueError(f"incomplete answer (text {reply is not None}, finish_reason {finish}, usage {usage})")
        result.prompt_tokens, result.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        result.ok = True
    except Exception as exc:  # a failed request is counted, and the client goes on
        result.total_s = time.perf_counter() - start
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    if chat:  # as chat clients do: the history goes with every request (the session reads only the new turn)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    return result


async def run_client(url: str, model: str, client: Client, args) -> None:
    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=args.timeout)
    history: list[dict] = []
    try:
        for request in range(args.requests):
            client.results.append(await one_request(api, model, client, request, args, history))
    finally:
        await api.close()


async def run_clients(url: str, model: str, clients: list[Client], args) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(run_client(url, model, client, args) for client in clients))
    return time.perf_counter() - start


# -- the checks ------------------------------------------------------------------------------

def session_problems(client: Client, state: dict | None, everyone: list[Client]) -> list[str]:
    """Why `client`'s session on the server is not exactly its own conversation (none: it is)."""
    if state is None:
        return ["GET /v1/sessions/ID found no such session"]
    problems = []
    named = {r.session for r in client.results if r.ok}
    if named != {client.session}:
        problems.append(f"answers named sessions {sorted(map(str, named))}")
    said = sum(r.prompt_tokens + r.completion_tokens for r in client.results if r.ok)
    if state.get("transcript_tokens") != said:
        problems.append(f"the session holds {state.get('transcript_tokens')} tokens said, its answers {said}")
    transcript, at = state.get("transcript", ""), 0
    for mark in client.markers:
        found = transcript.find(mark, at)
        if found < 0:
            problems.append(f"its marker {mark} is missing or out of order")
            break
        at = found + len(mark)
    foreign = [m for other in everyone if other is not client for m in other.markers if m in transcript]
    if foreign:
        problems.append(f"it holds other clients' markers {foreign[:3]}")
    return problems


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def ms(values: list[float], q: float = 0.5) -> float:
    """The nearest-rank `q` quantile of times in seconds, in ms (NaN when there are none)."""
    return nearest_rank(values, q) * 1000 if values else float("nan")


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    return "  ".join(f"{ms(values, q):8.1f}" for q in (0.5, 0.9, 0.99))


# -- main ------------------------------------------------------------------------------------

@dataclass
class Run:
    """One load test at one client count: what the clients saw and what the checks found."""

    clients: list[Client]
    wall: float
    states: dict[str, dict | None]
    metrics: str
    load: tuple[float, float, float]

    @property
    def results(self) -> list[Result]:
        return [r for client in self.clients for r in client.results]

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    @functools.cached_property
    def problems(self) -> dict[str, list[str]]:
        """Session -> why it is mixed (empty: it is not), for sessions whose requests all went through."""
        return {c.session: session_problems(c, self.states[c.session], self.clients)
                for c in self.clients if all(r.ok for r in c.results)}

    @property
    def mixed(self) -> dict[str, list[str]]:
        return {sid: p for sid, p in self.problems.items() if p}

    def tokens(self, kind: str) -> int:
        return sum(getattr(r, kind) for r in self.results if r.ok)

    @property
    def generated_per_s(self) -> float:
        return self.tokens("completion_tokens") / self.wall

    def latencies(self) -> list[float]:
        """Every request's whole time (s): the row that compares across client counts."""
        return [r.total_s for r in self.results if r.ok]

    def per_token(self) -> list[float]:
        """Every streamed request's time per output token after its first text (s)."""
        return [t for r in self.results if r.ok and (t := r.per_token_s) is not None]


def run_level(args, serve_flags: list[str], clients: int, say=print) -> Run:
    """Start a server, run `clients` clients against it, stop it; what they saw. `say`: progress."""
    if clients > 16 and "--max-sessions" not in serve_flags:  # serve's default: 16 sessions in memory
        serve_flags = serve_flags + ["--max-sessions", str(clients)]
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="serve-load-") as session_dir:
        server = Server(args.model, session_dir, serve_flags, args.startup_timeout)
        started = time.perf_counter()
        server.start()
        say(f"server up at {server.url} in {time.perf_counter() - started:.1f} s")
        try:
            everyone = [Client(i, f"load-{i:03d}") for i in range(clients)]
            wall = asyncio.run(run_clients(server.url, args.model, everyone, args))
            states = {}
            for client in everyone:
                response = httpx.get(f"{server.url}/v1/sessions/{client.session}", timeout=60)
                states[client.session] = response.json() if response.status_code == 200 else None
            metrics = httpx.get(server.url + "/metrics", timeout=60).text
        finally:
            server.stop()
    return Run(everyone, wall, states, metrics, load)


def machine_line(load: tuple[float, float, float], serve_flags: list[str]) -> str:
    import torch  # only for the header: the threads a server on this machine gets by default

    threads = next((serve_flags[i + 1] for i, f in enumerate(serve_flags[:-1]) if f in ("-t", "--threads")),
                   f"{torch.get_num_threads()} (torch default)")
    return (f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min), "
            f"torch threads {threads}, torch {torch.__version__}, "
            f"device {'cuda' if torch.cuda.is_available() else 'cpu'} (unless --device)")


def report(run: Run) -> None:
    """The table of one run (see the module docstring)."""
    results, failed, problems, mixed = run.results, run.failed, run.problems, run.mixed
    unchecked = len(run.clients) - len(problems)  # a failed request leaves its session's count unknown
    prompt, generated = run.tokens("prompt_tokens"), run.tokens("completion_tokens")
    counters = (metric(run.metrics, "positronic_prompt_tokens_total"),
                metric(run.metrics, "positronic_generated_tokens_total"))
    print()
    print(f"{'requests':<34}{len(results):>10}")
    print(f"{'failed requests':<34}{len(failed):>10}")
    print(f"{'mixed sessions':<34}{len(mixed):>10}" + (f"   ({unchecked} unchecked: a request failed)"
                                                         if unchecked else ""))
    print(f"{'server token counters match':<34}{'yes' if counters == (prompt, generated) else 'NO':>10}"
          + ("" if counters == (prompt, generated) else f"   (server {counters}, clients {(prompt, generated)})"))
    print(f"{'wall time (s)':<34}{run.wall:>10.2f}")
    print(f"{'generated tokens':<34}{generated:>10}")
    print(f"{'generated tokens/s':<34}{generated / run.wall:>10.1f}")
    print(f"{'prompt + generated tokens/s':<34}{(prompt + generated) / run.wall:>10.1f}")
    forwards, fed = metric(run.metrics, "positronic_batch_sequences_count"), metric(run.metrics, "positronic_batch_sequences_sum")
    if forwards:  # a server that batches: how many sequences a model forward fed, on average
        print(f"{'sequences per model forward':<34}{fed / forwards:>10.2f}   ({forwards:.0f} forwards)")
    print()
    print(f"{'latency (ms)':<34}{'n':>5}  {'p50':>8}  {'p90':>8}  {'p99':>8}")
    ok = [r for r in results if r.ok]
    rows = [("chat, whole request", [r.total_s for r in ok if r.kind == "chat"]),
            ("completion, whole request", [r.total_s for r in ok if r.kind == "completion"]),
            ("non-streamed, whole request", [r.total_s for r in ok if not r.kind.endswith("stream")]),
            ("streamed, first text", [r.first_s for r in ok if r.kind.endswith("stream")]),
            ("streamed, whole stream", [r.total_s for r in ok if r.kind.endswith("stream")]),
            ("streamed, per output token (TPOT)", run.per_token()),
            # every kind at every place in a session: the same mix at any number of clients (a
            # kind's own row is not: with one client, chat's requests are the 1st and 5th)
            ("every request, whole", run.latencies())]
    for name, values in rows:
        print(f"{name:<34}{len(values):>5}  {percentiles(values)}")
    for r in failed[:5]:
        print(f"failed ({r.kind}): {r.error}")
    for sid, p in list(mixed.items())[:5]:
        print(f"mixed {sid}: {'; '.join(p)}")


def compare(runs: dict[int, list[Run]]) -> None:
    """The levels side by side: per round, then medians over rounds and percentiles over every
    round's requests pooled; each level against the fewest clients."""
    levels = sorted(runs)
    base = levels[0]
    print()
    print(f"{'clients':>7}  {'round':>5}  {'load (1 min)':>12}  {'generated tok/s':>15}  {'p50 (ms)':>9}  "
          f"{'p90 (ms)':>9}  {'failed':>6}  {'mixed':>5}")
    for level in levels:
        for number, run in enumerate(runs[level], 1):
            p50, p90 = (ms(run.latencies(), q) for q in (0.5, 0.9))
            print(f"{level:>7}  {number:>5}  {run.load[0]:>12.2f}  {run.generated_per_s:>15.1f}  {p50:>9.0f}  "
                  f"{p90:>9.0f}  {len(run.failed):>6}  {len(run.mixed):>5}")
    print()
    print(f"{'clients':>7}  {'tok/s (median)':>14}  {'vs ' + str(base):>8}  {'p50 (median)':>12}  {'vs ' + str(base):>8}  "
          f"{'p50 (pooled)':>12}  {'vs ' + str(base):>8}  {'p99 (pooled)':>12}  {'TPOT p50 (pooled)':>17}  {'vs ' + str(base):>8}  "
          f"{'tok/s ratio by round':>22}  {'p50 ratio by round':>20}")

    def figures(level: int) -> tuple[float, float, float, float]:
        """Median tokens/s and p50 over the rounds; p50 and TPOT p50 of every round pooled."""
        return (statistics.median(r.generated_per_s for r in runs[level]),
                statistics.median(ms(r.latencies()) for r in runs[level]),
                ms([s for run in runs[level] for s in run.latencies()]),
                ms([s for run in runs[level] for s in run.per_token()]))

    base_figures = figures(base)
    for level in levels:
        rate, latency, pooled, tpot = ours = figures(level)
        vs = [a / b for a, b in zip(ours, base_figures)]
        p99 = ms([s for run in runs[level] for s in run.latencies()], 0.99)
        rounds = list(zip(runs[level], runs[base]))
        by_rate = "/".join(f"{a.generated_per_s / b.generated_per_s:.2f}" for a, b in rounds)
        by_p50 = "/".join(f"{ms(a.latencies()) / ms(b.latencies()):.2f}" for a, b in rounds)
        print(f"{level:>7}  {rate:>14.1f}  {vs[0]:>7.2f}x  {latency:>12.0f}  {vs[1]:>7.2f}x  "
              f"{pooled:>12.0f}  {vs[2]:>7.2f}x  {p99:>12.0f}  {tpot:>17.1f}  {vs[3]:>7.2f}x  {by_rate:>22}  {by_p50:>20}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog="Flags it does not know go to `positronic serve` (e.g. --budget 256).")
    parser.add_argument("--model", "-m", default="random:tiny",
                        help="the model served (random:tiny: no download; smollm2: the embedded model)")
    parser.add_argument("--clients", type=int, help="clients at once, a session each (default 8)")
    parser.add_argument("--levels", type=int, nargs="+", metavar="CLIENTS",
                        help="compare these client counts instead of one --clients run: each in turn, a fresh "
                             "server each, --rounds times; then a table of medians and ratios against the fewest")
    parser.add_argument("--rounds", type=int, help="with --levels: how many times each level runs (default 3)")
    parser.add_argument("--requests", type=int, default=20, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request asks for")
    parser.add_argument("--eos", action="store_true", help="let replies end at end-of-sequence (default: "
                        "ignore_eos, every reply max-tokens long)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds the server may take to start")
    args, serve_flags = parser.parse_known_args(argv)
    if args.levels is not None and args.clients is not None:
        parser.error("--clients runs one level and --levels several: give one of them")
    if args.levels is None and args.rounds is not None:
        parser.error("--rounds repeats --levels: give --levels too")
    args.clients = 8 if args.clients is None else args.clients
    args.rounds = 3 if args.rounds is None else args.rounds
    if min(args.clients, args.requests, args.max_tokens, args.rounds, *(args.levels or [1])) < 1:
        parser.error("--clients, --levels, --rounds, --requests and --max-tokens must be at least 1")
    if args.levels is not None and len(set(args.levels)) != len(args.levels):
        parser.error(f"--levels names a client count twice: {args.levels}")

    print(f"positronic serve -m {args.model} {' '.join(serve_flags)}".rstrip())
    levels = args.levels or [args.clients]
    print(f"{' / '.join(map(str, levels))} clients x {args.requests} requests, max_tokens {args.max_tokens}"
          f"{'' if args.eos else ' (ignore_eos)'}; mix: {', '.join(KINDS)}")
    print(machine_line(os.getloadavg(), serve_flags), flush=True)
    if args.levels is None:
        run = run_level(args, serve_flags, args.clients)
        report(run)
        return 1 if run.failed or run.mixed else 0
    runs: dict[int, list[Run]] = {level: [] for level in levels}
    for number in range(1, args.rounds + 1):
        for level in levels:  # in turn within each round: a drift of the machine's speed reaches every level
            print(f"round {number}/{args.rounds}, {level} client{'s' if level > 1 else ''}: ", end="", flush=True)
            run = run_level(args, serve_flags, level, say=lambda text: None)
            runs[level].append(run)
            print(f"{run.generated_per_s:.1f} generated tok/s, p50 {ms(run.latencies()):.0f} ms"
                  if run.latencies() else "no request went through", flush=True)
    compare(runs)
    bad = [run for level in levels for run in runs[level] if run.failed or run.mixed]
    for run in bad[:3]:
        report(run)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
