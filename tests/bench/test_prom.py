"""Prometheus adapters: each engine's names map to the common ones; window summaries."""

from __future__ import annotations

import pytest

from poise.bench.prom import (
    ADAPTERS,
    Scrape,
    detect_engine,
    histogram_quantile,
    map_scrape,
    parse_samples,
    summarize_window,
)

VLLM = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 11
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 6
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 8
vllm:time_to_first_token_seconds_count{model_name="m"} 8
vllm:time_to_first_token_seconds_sum{model_name="m"} 2.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{le="0.01",model_name="m"} 4
vllm:request_queue_time_seconds_bucket{le="1.0",model_name="m"} 8
vllm:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 8
vllm:request_queue_time_seconds_count{model_name="m"} 8
vllm:request_queue_time_seconds_sum{model_name="m"} 1.0
"""
SGLANG = """# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.4
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 5
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 2
# TYPE sglang:num_retracted_requests counter
sglang:num_retracted_requests_total{model_name="m"} 4
"""
TGI = """# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 6
# TYPE tgi_queue_size gauge
tgi_queue_size 1
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 300
# TYPE tgi_batch_max_total_tokens gauge
tgi_batch_max_total_tokens 1200
"""
LLAMACPP = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 9
"""


def test_vllm_sums_label_sets_and_reads_histogram() -> None:
    s = map_scrape(1.0, VLLM, ADAPTERS["vllm"])
    assert (s.kv_usage, s.running, s.waiting, s.preemptions) == (0.75, 3, 7, 11)
    assert s.ttft_buckets == [(0.1, 2), (0.5, 6), (float("inf"), 8)]
    assert detect_engine(list(parse_samples(VLLM)[0])) == "vllm"
    assert s.hists["queue_time"] == [(0.01, 4), (1.0, 8), (float("inf"), 8)]
    zero = map_scrape(0.0, "", ADAPTERS["vllm"])
    out = summarize_window([zero, s], 0.0, 1.0)
    assert out["server_queue_time_ms"]["n"] == 8
    assert out["server_queue_time_ms"]["p50"] == pytest.approx(10.0)
    assert out["server_prefill_time_ms"] is None  # not exposed in this text: not invented


def test_poise_uses_vllm_names_with_its_prefix() -> None:
    text = VLLM.replace("vllm:", "poise:")
    s = map_scrape(0.0, text, ADAPTERS["poise"])
    assert s.preemptions == 11 and s.running == 3
    assert detect_engine(list(parse_samples(text)[0])) == "poise"


@pytest.mark.parametrize(
    ("engine", "text", "expected"),
    [
        ("sglang", SGLANG, (0.4, 5, 2, 4)),
        ("tgi", TGI, (0.25, 6, 1, None)),
        ("llamacpp", LLAMACPP, (None, 2, 9, None)),
    ],
)
def test_other_engines(engine: str, text: str, expected: tuple[object, ...]) -> None:
    s = map_scrape(0.0, text, ADAPTERS[engine])
    assert (s.kv_usage, s.running, s.waiting, s.preemptions) == expected
    assert detect_engine(list(parse_samples(text)[0])) == engine


def test_histogram_quantile() -> None:
    b = [(0.1, 2.0), (0.5, 6.0), (float("inf"), 8.0)]
    assert histogram_quantile(b, 0.25) == pytest.approx(0.1)
    assert histogram_quantile(b, 0.5) == pytest.approx(0.3)
    assert histogram_quantile(b, 0.99) == 0.5  # open bucket: its lower edge
    assert histogram_quantile([], 0.5) is None


def test_window_summary_uses_counter_deltas_and_gauges_inside() -> None:
    scrapes = [
        Scrape(0.0, 0.1, 1, 0, 5, [(0.1, 0.0), (float("inf"), 0.0)]),
        Scrape(1.0, 0.6, 4, 2, 7, [(0.1, 1.0), (float("inf"), 2.0)]),
        Scrape(2.0, 0.3, 2, 0, 9, [(0.1, 3.0), (float("inf"), 4.0)]),
        Scrape(3.0, 0.0, 0, 0, 9, [(0.1, 3.0), (float("inf"), 4.0)]),
    ]
    out = summarize_window(scrapes, 0.5, 2.5)
    assert out["kv_usage"] == {"peak": 0.6, "mean": pytest.approx(0.45)}
    assert out["running"]["max"] == 4 and out["waiting"]["max"] == 2
    assert out["preemptions"] == 4  # 9 (first scrape after) - 5 (last before)
    assert out["server_ttft_ms"]["n"] == 4
    no_counter = [Scrape(0.0, 0.1), Scrape(1.0, 0.2)]
    assert summarize_window(no_counter, 0, 1)["preemptions"] is None


def test_prefix_cache_hit_rate_is_the_window_delta_of_the_counters() -> None:
    def text(hits: int, queries: int) -> str:
        return (
            f'poise:prefix_cache_hits_total{{model_name="m"}} {hits}\n'
            f'poise:prefix_cache_queries_total{{model_name="m"}} {queries}\n'
        )

    a = map_scrape(0.0, text(100, 1000), ADAPTERS["poise"])
    b = map_scrape(2.0, text(400, 1600), ADAPTERS["poise"])
    assert (a.prefix_hits, a.prefix_queries) == (100, 1000)
    # 300 of the 600 prompt tokens looked up during the window came from the cache.
    assert summarize_window([a, b], 0.0, 2.0)["prefix_cache_hit_rate"] == 0.5
    none = map_scrape(0.0, "", ADAPTERS["poise"])
    assert summarize_window([none, none], 0.0, 1.0)["prefix_cache_hit_rate"] is None
