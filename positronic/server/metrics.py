"""The server's numbers for `GET /metrics`, in the Prometheus text exposition format, kept and
written by prometheus_client. Each Metrics has a CollectorRegistry of its own: tests run many
servers in one process, and the library's global registry would add their counts together.

    positronic_requests_total{endpoint,status}     requests answered
    positronic_request_duration_seconds{endpoint}  histogram: request start to last byte
    positronic_time_to_first_token_seconds         histogram: a generation request's arrival
                                                   to its first generated token's text
    positronic_inter_token_latency_seconds         histogram: the gap between consecutive
                                                   generated tokens of one reply
    positronic_generated_tokens_total              tokens generated for replies
    positronic_prompt_tokens_total                 prompt and turn tokens read
    positronic_ticks_total, positronic_tick_seconds_total   brain steps and the time in them
    positronic_batch_sequences                     histogram: sequences fed by each model forward
                                                   (a batched round: positronic.batch)
    positronic_evictions_total, positronic_repairs_total, positronic_resurrections_total
    positronic_tokens_per_second                   ticks per second of stepping, last 60 s
    positronic_live_length{session}, positronic_budget{session}   each session in memory
    positronic_sessions{state}, positronic_sessions_saved_total, …_resumed_total, …_freed_total
    positronic_session_save_failures_total         checkpoints that could not be written
    positronic_requests_in_flight

and beside them vLLM's names, each labelled model_name, so that a dashboard made for vLLM reads
this server (what each counts here: docs/server.md, "Metrics"):

    vllm:num_requests_running, vllm:num_requests_waiting   generation requests ticking / queued
    vllm:kv_cache_usage_perc                      live rows over budget, sessions in memory (0..1)
    vllm:prompt_tokens_total, vllm:generation_tokens_total
    vllm:request_success_total{finished_reason}   replies ended: stop | length | abort (cut short)
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:e2e_request_latency_seconds              histograms (the last: generation requests answered)

Counters and histograms are fed as things happen (prometheus_client adds a `…_created` time to
each). The families from tokens per second on are read at scrape time (ScrapeTime): the tick
rate from here, the rest from what the server hands `render`. `Metrics.content_type` is the
media type of `render`'s text.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..state.actions import rows_of
from ..brain.loop import TickRecord

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# A token takes about 0.01 s on a GPU and 0.1 s on a CPU: both speeds get buckets of their
# own, and the top ones catch a gap stretched by other sessions' ticks or a checkpoint save.
INTER_TOKEN_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
# The first token also waits for the queue and the prompt's prefill, seconds on a CPU.
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 60.0
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")  # what vLLM's request metrics count


class ScrapeTime(Collector):
    """The families read from the server when it is scraped rather than counted here: the
    last `render`'s inputs, and the tick rate of the moment."""

    def __init__(self, tokens_per_second, model_name: str):
        self.tokens_per_second, self.model_name = tokens_per_second, model_name
        self.given = dict(sessions={}, session_states={}, session_events={}, in_flight=0, save_failures=0, running=0)

    def collect(self):
        given = self.given
        yield GaugeMetricFamily("positronic_tokens_per_second",
                                f"Tokens per second of stepping, last {RATE_WINDOW_S:.0f} s.",
                                value=self.tokens_per_second())
        live = GaugeMetricFamily("positronic_live_length", "Live context length of each session in memory.",
                                 labels=["session"])
        budget = GaugeMetricFamily("positronic_budget", "Live context budget of each session in memory.",
                                   labels=["session"])
        for sid, (length, cap) in sorted(given["sessions"].items()):
            live.add_metric([sid], length)
            budget.add_metric([sid], cap)
        yield live
        yield budget
        states = GaugeMetricFamily("positronic_sessions", "Conversations by state.", labels=["state"])
        for state, n in sorted(given["session_states"].items()):
            states.add_metric([state], n)
        yield states
        for event, n in sorted(given["session_events"].items()):
            yield CounterMetricFamily(f"positronic_sessions_{event}", f"Sessions {event}.", value=n)
        yield CounterMetricFamily("positronic_session_save_failures", "Session checkpoints that could not be written.",
                                  value=given["save_failures"])
        yield GaugeMetricFamily("positronic_requests_in_flight", "Generation requests in the server, queued included.",
                                value=given["in_flight"])
        running = min(given["running"], given["in_flight"])
        rows = sum(length for length, _ in given["sessions"].values())
        room = sum(cap for _, cap in given["sessions"].values())
        for name, text, value in (
                ("vllm:num_requests_running", "Generation requests whose turn is ticking.", running),
                ("vllm:num_requests_waiting", "Generation requests queued (for a session slot or their "
                                              "session's previous request).", given["in_flight"] - running),
                ("vllm:kv_cache_usage_perc", "Live rows over the budgets of the sessions in memory (1 = full).",
                 rows / room if room else 0.0)):
            family = GaugeMetricFamily(name, text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class Metrics:
    """Counters the server feeds (ticks from every conversation, requests from the HTTP
    layer, token timings from replies) and the exposition of them with the gauges the caller
    reads at scrape time. prometheus_client's values take a lock, so the model thread may
    feed them while the event loop scrapes."""

    content_type = CONTENT_TYPE_LATEST  # of what `render` writes

    def __init__(self, model_name: str = ""):
        self.registry = CollectorRegistry()
        counter = partial(Counter, registry=self.registry)
        histogram = partial(Histogram, registry=self.registry)
        self.model_name = model_name
        self.requests = counter("positronic_requests", "HTTP requests answered, by endpoint and status.",
                                ["endpoint", "status"])
        self.latency = histogram("positronic_request_duration_seconds",
                                 "Request latency, first byte in to last byte out.", ["endpoint"],
                                 buckets=LATENCY_BUCKETS)
        self.first_token = histogram("positronic_time_to_first_token_seconds",
                                     "A generation request's arrival to its first generated token's text.",
                                     buckets=FIRST_TOKEN_BUCKETS)
        self.inter_token = histogram("positronic_inter_token_latency_seconds",
                                     "The gap between consecutive generated tokens of one reply.",
                                     buckets=INTER_TOKEN_BUCKETS)
        self.generated_tokens = counter("positronic_generated_tokens", "Tokens generated for replies.")
        self.prompt_tokens = counter("positronic_prompt_tokens", "Prompt and turn tokens read into the brains.")
        self.ticks = counter("positronic_ticks", "Brain steps (one token each), every session.")
        self.tick_seconds = counter("positronic_tick_seconds", "Seconds spent in brain steps.")
        self.evictions = counter("positronic_evictions", "Rows culled from a live context.")
        self.repairs = counter("positronic_repairs", "Pairs of rows replaced by a repair.")
        self.resurrections = counter("positronic_resurrections", "Evicted rows brought back by recall.")
        self.batch = histogram("positronic_batch_sequences", "Sequences fed by each model forward (batched ticks).",
                               buckets=BATCH_BUCKETS)
        self.vllm = VLLMNames(counter, histogram, model_name)
        # the rest of vLLM's families are the project's own, named vLLM's way when scraped
        self.registry.register(Renamed({self.prompt_tokens: "vllm:prompt_tokens",
                                        self.generated_tokens: "vllm:generation_tokens",
                                        self.first_token: "vllm:time_to_first_token_seconds",
                                        self.inter_token: "vllm:inter_token_latency_seconds"}, model_name))
        self._recent: deque[tuple[float, float]] = deque()  # (time, seconds) of recent ticks
        self._recent_lock = threading.Lock()  # ticks come from the model thread, scrapes from the loop
        self._scrape = ScrapeTime(self.tokens_per_second, model_name)
        self.registry.register(self._scrape)
        self._render_lock = threading.Lock()  # a scrape's inputs stay put until its text is written

    def record_tick(self, record: TickRecord, seconds: float) -> None:
        """One brain step of any conversation (on the model thread)."""
        self.ticks.inc()
        self.tick_seconds.inc(seconds)
        if not record.rebuilt:  # a failed tick's actions were never applied
            self.evictions.inc(sum(len(rows_of(a)) for a in record.actions if a["action"] == "delete"))
            self.repairs.inc(sum(a["action"] == "replace_pair" for a in record.actions))
            self.resurrections.inc(sum(len(a["ledger_ids"]) for a in record.actions if a["action"] == "restore"))
        with self._recent_lock:
            self._recent.append((time.monotonic(), seconds))

    def record_batch(self, sequences: int) -> None:
        """One model forward of the batching worker, and how many sequences it fed."""
        self.batch.observe(sequences)

    def record_reply(self, prompt_tokens: int, generated_tokens: int, finish_reason: str | None = "stop") -> None:
        """One request's tokens: read into the brain, and generated for its reply, which ended
        with `finish_reason` (stop, length; None: cut short, vLLM's "abort")."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated_tokens)
        self.vllm.success.labels(self.model_name, finish_reason or "abort").inc()

    def record_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)
        if endpoint in GENERATION_ENDPOINTS and status == 200:
            self.vllm.e2e.observe(seconds)

    def record_first_token(self, seconds: float) -> None:
        """A generation request's arrival to its first generated token's text being ready."""
        self.first_token.observe(seconds)

    def record_inter_token(self, seconds: float) -> None:
        """The gap between two consecutive generated tokens of one reply."""
        self.inter_token.observe(seconds)

    def record_token(self, first: bool, seconds: float) -> None:
        """A generated token: the request's first (seconds since the request arrived) or a later one."""
        (self.record_first_token if first else self.record_inter_token)(seconds)

    def tokens_per_second(self) -> float:
        """Ticks per second of stepping over the last RATE_WINDOW_S (0 when idle)."""
        horizon = time.monotonic() - RATE_WINDOW_S
        with self._recent_lock:
            while self._recent and self._recent[0][0] < horizon:
                self._recent.popleft()
            count, busy = len(self._recent), sum(seconds for _, seconds in self._recent)
        return count / busy if busy > 0 else 0.0

    def render(self, *, sessions: dict[str, tuple[int, int]], session_states: dict[str, int],
               session_events: dict[str, int], in_flight: int, save_failures: int = 0, running: int = 0) -> str:
        """The exposition text. `sessions`: id -> (live length, budget) of each session in
        memory; `session_states`: count per state; `session_events`: saved/resumed/freed counts;
        `running`: the requests in flight whose turn is ticking (the rest wait)."""
        with self._render_lock:
            self._scrape.given = dict(sessions=sessions, session_states=session_states,
                                      session_events=session_events, in_flight=in_flight,
                                      save_failures=save_failures, running=running)
            return generate_latest(self.registry).decode()


class VLLMNames:
    """vLLM's families the project's own do not count (`Renamed` gives the others), labelled
    model_name, fed by `Metrics`: replies by finish reason, generation requests' latency."""

    def __init__(self, counter, histogram, model_name: str):
        self.success = counter("vllm:request_success", "Generation requests ended, by finish reason.",
                               ["model_name", "finished_reason"])
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Generation request latency, first byte in to "
                             "last byte out.", ["model_name"], buckets=LATENCY_BUCKETS).labels(model_name)


class Renamed(Collector):
    """Metrics of the registry's own under other names (vLLM's), each sample labelled
    model_name: the same numbers, counted once."""

    def __init__(self, names: dict, model_name: str):
        self.names, self.model_name = names, model_name

    def collect(self):
        for metric, name in self.names.items():
            for family in metric.collect():
                renamed = Metric(name, family.documentation, family.type)
                for sample in family.samples:  # NAME_total, NAME_bucket, NAME_created, ...: the suffix kept
                    renamed.add_sample(name + sample.name[len(family.name):],
                                       {**sample.labels, "model_name": self.model_name}, sample.value)
                yield renamed
