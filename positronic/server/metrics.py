"""The server's numbers in the Prometheus text exposition format (version 0.0.4), for
`GET /metrics`: written here, it is a few lines of text.

    positronic_requests_total{endpoint,status}     requests answered
    positronic_request_duration_seconds{endpoint}  histogram: request start to last byte
    positronic_generated_tokens_total              tokens generated for replies
    positronic_prompt_tokens_total                 prompt and turn tokens read
    positronic_ticks_total, positronic_tick_seconds_total   brain steps and the time in them
    positronic_tokens_per_second                   ticks per second of stepping, last 60 s
    positronic_evictions_total, positronic_repairs_total, positronic_resurrections_total
    positronic_live_length{session}, positronic_budget{session}   each session in memory
    positronic_sessions{state}, positronic_sessions_saved_total, …_resumed_total, …_freed_total
    positronic_session_save_failures_total         checkpoints that could not be written
    positronic_requests_in_flight
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from ..state.actions import rows_of
from ..brain.loop import TickRecord

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_WINDOW_S = 60.0


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(10), "").replace(chr(34), chr(92) + chr(34))}"'
               for k, v in labels.items())
    return "{" + ",".join(escaped) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class Histogram:
    """Cumulative buckets, a sum and a count, per label set."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self._series: dict[tuple, list] = {}  # label items -> [bucket counts..., sum, count]

    def observe(self, value: float, **labels) -> None:
        series = self._series.setdefault(tuple(sorted(labels.items())), [0] * len(self.buckets) + [0.0, 0])
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                series[i] += 1
        series[-2] += value
        series[-1] += 1

    def lines(self, name: str) -> list[str]:
        out = []
        for key, series in sorted(self._series.items()):
            labels = dict(key)
            for bound, count in zip(self.buckets + (math.inf,), series[:len(self.buckets)] + [series[-1]]):
                out.append(f"{name}_bucket{_labels({**labels, 'le': _number(float(bound))})} {count}")
            out.append(f"{name}_sum{_labels(labels)} {_number(series[-2])}")
            out.append(f"{name}_count{_labels(labels)} {series[-1]}")
        return out


class Metrics:
    """Counters the server feeds (ticks from every conversation, requests from the HTTP
    layer) and the exposition of them with the gauges the caller reads at scrape time."""

    def __init__(self):
        self.requests: dict[tuple[str, str], int] = {}
        self.latency = Histogram()
        self.counts = dict(generated_tokens=0, prompt_tokens=0, ticks=0, evictions=0, repairs=0, resurrections=0)
        self.tick_seconds = 0.0
        self._recent: deque[tuple[float, float]] = deque()  # (time, seconds) of recent ticks
        self._recent_lock = threading.Lock()  # ticks come from the model thread, scrapes from the loop

    def record_tick(self, record: TickRecord, seconds: float) -> None:
        """One brain step of any conversation (on the model thread: plain counters only)."""
        c = self.counts
        c["ticks"] += 1
        self.tick_seconds += seconds
        if not record.rebuilt:
            kinds = [a["action"] for a in record.actions]
            c["evictions"] += sum(len(rows_of(a)) for a in record.actions if a["action"] == "delete")
            c["repairs"] += kinds.count("replace_pair")
            c["resurrections"] += sum(len(a["ledger_ids"]) for a in record.actions if a["action"] == "restore")
        with self._recent_lock:
            self._recent.append((time.monotonic(), seconds))

    def record_reply(self, prompt_tokens: int, generated_tokens: int) -> None:
        """One request's tokens: read into the brain, and generated for its reply."""
        self.counts["prompt_tokens"] += prompt_tokens
        self.counts["generated_tokens"] += generated_tokens

    def record_request(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1
        self.latency.observe(seconds, endpoint=endpoint)

    def tokens_per_second(self) -> float:
        """Ticks per second of stepping over the last RATE_WINDOW_S (0 when idle)."""
        horizon = time.monotonic() - RATE_WINDOW_S
        with self._recent_lock:
            while self._recent and self._recent[0][0] < horizon:
                self._recent.popleft()
            count, busy = len(self._recent), sum(seconds for _, seconds in self._recent)
        return count / busy if busy > 0 else 0.0

    def render(self, *, sessions: dict[str, tuple[int, int]], session_states: dict[str, int],
               session_events: dict[str, int], in_flight: int, save_failures: int = 0) -> str:
        """The exposition text. `sessions`: id -> (live length, budget) of each session in
        memory; `session_states`: count per state; `session_events`: saved/resumed/freed counts."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples)

        c = self.counts
        family("positronic_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
               [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
        out.append("# HELP positronic_request_duration_seconds Request latency, first byte in to last byte out.")
        out.append("# TYPE positronic_request_duration_seconds histogram")
        out.extend(self.latency.lines("positronic_request_duration_seconds"))
        family("positronic_generated_tokens_total", "counter", "Tokens generated for replies.",
               [({}, c["generated_tokens"])])
        family("positronic_prompt_tokens_total", "counter", "Prompt and turn tokens read into the brains.",
               [({}, c["prompt_tokens"])])
        family("positronic_ticks_total", "counter", "Brain steps (one token each), every session.", [({}, c["ticks"])])
        family("positronic_tick_seconds_total", "counter", "Seconds spent in brain steps.", [({}, self.tick_seconds)])
        family("positronic_tokens_per_second", "gauge", f"Tokens per second of stepping, last {RATE_WINDOW_S:.0f} s.",
               [({}, self.tokens_per_second())])
        family("positronic_evictions_total", "counter", "Rows culled from a live context.", [({}, c["evictions"])])
        family("positronic_repairs_total", "counter", "Pairs of rows replaced by a repair.", [({}, c["repairs"])])
        family("positronic_resurrections_total", "counter", "Evicted rows brought back by recall.",
               [({}, c["resurrections"])])
        family("positronic_live_length", "gauge", "Live context length of each session in memory.",
               [({"session": sid}, live) for sid, (live, _) in sorted(sessions.items())])
        family("positronic_budget", "gauge", "Live context budget of each session in memory.",
               [({"session": sid}, budget) for sid, (_, budget) in sorted(sessions.items())])
        family("positronic_sessions", "gauge", "Conversations by state.",
               [({"state": state}, n) for state, n in sorted(session_states.items())])
        for event, n in sorted(session_events.items()):
            family(f"positronic_sessions_{event}_total", "counter", f"Sessions {event}.", [({}, n)])
        family("positronic_session_save_failures_total", "counter", "Session checkpoints that could not be written.",
               [({}, save_failures)])
        family("positronic_requests_in_flight", "gauge", "Generation requests in the server, queued included.",
               [({}, in_flight)])
        return "\n".join(out) + "\n"
