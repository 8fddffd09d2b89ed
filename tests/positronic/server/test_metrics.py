"""The server's metrics (positronic/server/metrics.py): what GET /metrics counts after real
requests, the Prometheus exposition itself (read back with prometheus_client's own parser),
the token-timing histograms, and one server's numbers kept apart from another's."""

import re

from prometheus_client.parser import text_string_to_metric_families

from positronic.brain.loop import TickRecord
from positronic.server.metrics import Metrics

MODEL = "random:tiny"
GOOD = {"model": MODEL, "prompt": "ok", "max_tokens": 2}


def test_metrics_count_tokens_requests_and_maintenance(tiny, tmp_path, live_server, server_settings, server_config, chat, metric):
    with live_server(tiny, server_settings(tmp_path)) as server:
        client = server.client()
        first = client.completions.create(model=MODEL, prompt="count me", max_tokens=100, user="m",
                                          extra_body={"ignore_eos": True})
        second = chat(client, None, "and me", max_tokens=7, extra_body={"ignore_eos": True})
        bad = server.post("/v1/completions", {**GOOD, "max_tokens": 0})
        assert bad.status_code == 400
        scrape = server.get("/metrics")
    text = scrape.text
    assert scrape.headers["content-type"].startswith("text/plain; version=")  # the text format, not OpenMetrics
    generated = first.usage.completion_tokens + second.usage.completion_tokens
    assert metric(text, "positronic_generated_tokens_total") == generated == 107
    assert metric(text, "positronic_prompt_tokens_total") == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert metric(text, "positronic_ticks_total") == generated  # prompts are prefilled, not ticked
    assert metric(text, "positronic_requests_total", endpoint="/v1/completions", status="200") == 1
    assert metric(text, "positronic_requests_total", endpoint="/v1/completions", status="400") == 1
    assert metric(text, "positronic_evictions_total") >= 9 + 100 - server_config.budget  # 109 tokens in a 96 budget
    assert metric(text, "positronic_repairs_total") == 0 and metric(text, "positronic_resurrections_total") == 0
    assert metric(text, "positronic_live_length", session="m") == first.model_extra["positronic"]["live_length"] <= server_config.budget
    assert metric(text, "positronic_budget", session="m") == server_config.budget
    assert metric(text, "positronic_tokens_per_second") > 0
    # each reply's first token is timed from its request's arrival, each later one from the token before
    assert metric(text, "positronic_time_to_first_token_seconds_count") == 2
    assert metric(text, "positronic_inter_token_latency_seconds_count") == generated - 2
    assert 0 < metric(text, "positronic_time_to_first_token_seconds_sum") < 60
    count = metric(text, "positronic_request_duration_seconds_count", endpoint="/v1/chat/completions")
    assert count == 1 == metric(text, "positronic_request_duration_seconds_bucket", endpoint="/v1/chat/completions",
                                le="+Inf")
    buckets = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('positronic_request_duration_seconds_bucket{endpoint="/v1/completions"')]
    assert buckets == sorted(buckets) and buckets[-1] == 2
    assert "# TYPE positronic_request_duration_seconds histogram" in text
    for line in text.splitlines():  # every sample line is NAME{LABELS} NUMBER
        assert line.startswith("#") or re.fullmatch(r'[a-z_:][a-z0-9_:]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [-+.\deInf]+',
                                                    line), line
    # vLLM's names beside them, labelled with the model: what a vLLM dashboard reads
    named = dict(model_name=MODEL)
    assert metric(text, "vllm:generation_tokens_total", **named) == generated
    assert metric(text, "vllm:prompt_tokens_total", **named) == metric(text, "positronic_prompt_tokens_total")
    assert metric(text, "vllm:request_success_total", finished_reason="length", **named) == 2  # both ran to max_tokens
    assert metric(text, "vllm:time_to_first_token_seconds_count", **named) == 2
    assert metric(text, "vllm:inter_token_latency_seconds_count", **named) == generated - 2
    assert metric(text, "vllm:e2e_request_latency_seconds_count", **named) == 2  # the 400 is not a request served
    assert metric(text, "vllm:num_requests_running", **named) == 0 == metric(text, "vllm:num_requests_waiting", **named)
    sessions = re.findall(r'^positronic_live_length\{session="([^"]*)"\}', text, re.M)
    live = sum(metric(text, "positronic_live_length", session=sid) for sid in sessions)
    room = sum(metric(text, "positronic_budget", session=sid) for sid in sessions)
    assert sessions and metric(text, "vllm:kv_cache_usage_perc", **named) == live / room


def record(actions, rebuilt=False):
    return TickRecord(tick=1, token_id=5, text="x", actions=actions, outcomes=[], live_length=10, brightness_min=0.0,
                      brightness_mean=0.0, brightness_max=0.0, rebuilt=rebuilt)


def test_ticks_count_evicted_rows_repairs_and_resurrections_but_nothing_of_a_failed_tick():
    metrics = Metrics()
    metrics.record_tick(record([{"action": "delete", "position": 3}, {"action": "delete", "position": 4},
                                {"action": "replace_pair", "original_pos1": 6, "original_pos2": 7, "new_token_ids": [9]},
                                {"action": "restore", "ledger_ids": [1, 2, 8], "token_ids": [4, 4, 4]},
                                {"action": "add", "token_id": 5}]), 0.5)
    metrics.record_tick(record([{"action": "delete", "position": 1}], rebuilt=True), 0.25)
    metrics.record_reply(prompt_tokens=7, generated_tokens=3)
    text = metrics.render(sessions={}, session_states={}, session_events={}, in_flight=0)
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["positronic_ticks_total"] == 2 and values["positronic_tick_seconds_total"] == 0.75
    assert (values["positronic_evictions_total"], values["positronic_repairs_total"],
            values["positronic_resurrections_total"]) == (2, 1, 3), "the failed tick's delete is not counted"
    assert (values["positronic_prompt_tokens_total"], values["positronic_generated_tokens_total"]) == (7, 3)
    assert values["positronic_tokens_per_second"] == 2 / 0.75


def test_the_latency_histogram_is_cumulative_with_sum_count_and_inf(metric):
    metrics = Metrics()
    for seconds in (0.01, 0.07, 0.3, 200.0):
        metrics.record_request("/v1/completions", 200, seconds)
    metrics.record_request("/v1/completions", 400, 0.02)
    text = metrics.render(sessions={"a": (40, 96)}, session_states={"idle": 1}, session_events={"saved": 2},
                          in_flight=1)
    bucket = "positronic_request_duration_seconds_bucket"
    assert metric(text, bucket, endpoint="/v1/completions", le="0.05") == 2
    assert metric(text, bucket, endpoint="/v1/completions", le="0.1") == 3
    assert metric(text, bucket, endpoint="/v1/completions", le="120.0") == 4
    assert metric(text, bucket, endpoint="/v1/completions", le="+Inf") == 5
    assert metric(text, "positronic_request_duration_seconds_count", endpoint="/v1/completions") == 5
    assert metric(text, "positronic_request_duration_seconds_sum", endpoint="/v1/completions") == \
        sum((0.01, 0.07, 0.3, 200.0, 0.02))
    assert metric(text, "positronic_requests_total", endpoint="/v1/completions", status="400") == 1
    assert metric(text, "positronic_live_length", session="a") == 40 and metric(text, "positronic_budget", session="a") == 96
    assert metric(text, "positronic_sessions", state="idle") == 1
    assert metric(text, "positronic_sessions_saved_total") == 2 and metric(text, "positronic_requests_in_flight") == 1
    assert metric(text, "positronic_tokens_per_second") == 0, "idle: no rate"


def test_label_values_are_escaped_so_a_session_id_cannot_break_the_exposition(metric):
    metrics = Metrics()
    odd = '/v1/"odd"\\path\n'
    metrics.record_request(odd, 200, 0.1)
    metrics.record_request("/v1/completions", 200, 0.1)
    text = metrics.render(sessions={odd: (1, 2)}, session_states={}, session_events={}, in_flight=0)
    line = next(line for line in text.splitlines() if line.startswith("positronic_requests_total{"))
    assert line == 'positronic_requests_total{endpoint="/v1/\\"odd\\"\\\\path\\n",status="200"} 1.0'
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("positronic_requests_total", (("endpoint", odd), ("status", "200")))] == 1, "read back whole"
    assert samples[("positronic_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1
    assert samples[("positronic_live_length", (("session", odd),))] == 1


def test_time_to_first_token_and_inter_token_latency_are_histograms_from_the_start(metric):
    text = Metrics().render(sessions={}, session_states={}, session_events={}, in_flight=0)
    for name in ("positronic_time_to_first_token_seconds", "positronic_inter_token_latency_seconds"):
        assert f"# TYPE {name} histogram" in text
        assert metric(text, name + "_count") == 0 == metric(text, name + "_bucket", le="+Inf")


def test_first_token_and_inter_token_observations_are_counted_and_bucketed(metric):
    metrics = Metrics()
    for seconds in (0.02, 0.3, 4.0):  # a GPU's prefill, a CPU's, a long queue
        metrics.record_first_token(seconds)
    for seconds in (0.008, 0.012, 0.09, 0.11, 3.0):  # GPU-speed and CPU-speed tokens, a stall
        metrics.record_inter_token(seconds)
    text = metrics.render(sessions={}, session_states={}, session_events={}, in_flight=0)
    first, gap = "positronic_time_to_first_token_seconds", "positronic_inter_token_latency_seconds"
    assert metric(text, first + "_count") == 3 and metric(text, first + "_sum") == 0.02 + 0.3 + 4.0
    assert [metric(text, first + "_bucket", le=le) for le in ("0.025", "0.25", "0.5", "5.0", "+Inf")] == [1, 1, 2, 3, 3]
    assert metric(text, gap + "_count") == 5 and metric(text, gap + "_sum") == sum((0.008, 0.012, 0.09, 0.11, 3.0))
    assert [metric(text, gap + "_bucket", le=le) for le in ("0.01", "0.02", "0.1", "0.15", "2.5", "+Inf")] == \
        [1, 2, 3, 4, 4, 5], "GPU and CPU speeds fall in buckets of their own"


def test_vllm_request_gauges_split_in_flight_and_a_cut_reply_is_an_abort(metric):
    metrics = Metrics(model_name="m")
    metrics.record_reply(prompt_tokens=3, generated_tokens=1, finish_reason=None)
    metrics.record_reply(prompt_tokens=3, generated_tokens=4, finish_reason="stop")
    text = metrics.render(sessions={"a": (30, 40), "b": (10, 40)}, session_states={}, session_events={}, in_flight=5,
                          running=2)
    assert metric(text, "vllm:request_success_total", finished_reason="abort", model_name="m") == 1
    assert metric(text, "vllm:request_success_total", finished_reason="stop", model_name="m") == 1
    assert metric(text, "vllm:num_requests_running", model_name="m") == 2
    assert metric(text, "vllm:num_requests_waiting", model_name="m") == 3
    assert metric(text, "vllm:kv_cache_usage_perc", model_name="m") == 0.5


def test_two_servers_metrics_do_not_share_values(metric):
    busy, quiet = Metrics(), Metrics()
    busy.record_tick(record([{"action": "delete", "position": 3}]), 0.1)
    busy.record_reply(prompt_tokens=4, generated_tokens=2)
    busy.record_request("/v1/completions", 200, 0.5)
    busy.record_first_token(0.2)
    busy.record_inter_token(0.05)
    text = quiet.render(sessions={}, session_states={}, session_events={}, in_flight=0)
    for name in ("positronic_ticks_total", "positronic_evictions_total", "positronic_generated_tokens_total",
                 "positronic_prompt_tokens_total", "positronic_time_to_first_token_seconds_count",
                 "positronic_inter_token_latency_seconds_count"):
        assert metric(text, name) == 0, name
    assert "positronic_requests_total{" not in text
    assert metric(busy.render(sessions={}, session_states={}, session_events={}, in_flight=0),
                  "positronic_ticks_total") == 1
