"""Metrics observed when they happen: TTFT before the request ends, aborted requests in the TTFT
histogram, TTFT's parts adding up, prefix-cache counters; the server's self-description.

The real EngineCore, AsyncEngine and app around the deterministic fake executor, slowed down
per step so a test can look at /metrics while a request is still running.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from poise.config import EngineConfig
from poise.core.outputs import ModelRunnerOutput, SchedulerOutput
from poise.core.sampling_params import SamplingParams
from poise.core.timing import derive
from poise.engine.clock import VirtualClock
from poise.engine.core import EngineCore
from poise.serving.server import build_state
from poise.serving.settings import ServerSettings
from poise.text import eos_token_ids
from tests.serving.conftest import InProcessServer, metric_value
from tests.unit.fake_executor import FakeExecutor


class SlowExecutor(FakeExecutor):
    def __init__(self, vocab: int, block_size: int, delay_s: float) -> None:
        super().__init__(vocab, block_size)
        self.delay_s = delay_s

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self.delay_s)
        return super().execute(scheduler_output)


class ClockedExecutor(FakeExecutor):
    """Each step takes 0.1 s of the virtual clock."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(1000, 4)
        self.clock = clock

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.clock.advance(0.1)
        return super().execute(scheduler_output)


def slow_server(
    tokenizer: Any, delay_s: float = 0.02, log_requests: bool = False, **engine_kwargs: Any
) -> InProcessServer:
    vocab = len(tokenizer)
    cfg = EngineConfig.from_kwargs(block_size=16, **engine_kwargs)
    core = EngineCore(
        cfg,
        SlowExecutor(vocab, 16, delay_s),
        num_kv_blocks=256,
        max_model_len=1024,
        vocab_size=vocab,
        eos_token_ids=eos_token_ids(tokenizer),
    )
    settings = ServerSettings(enable_log_requests=log_requests)
    state = build_state(core, tokenizer, model_name="fake", vocab_size=vocab, settings=settings)
    return InProcessServer(state)


def metrics(server: InProcessServer) -> str:
    return httpx.get(server.base_url + "/metrics").text


def wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _stream(server: InProcessServer, prompt: list[int], max_tokens: int) -> Any:
    body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    return httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30)


def test_ttft_and_itl_are_in_metrics_before_the_stream_ends(smol_tokenizer: Any) -> None:
    with slow_server(smol_tokenizer) as server, _stream(server, [5, 6, 7], 60) as resp:
        lines = resp.iter_lines()  # kept: closing this generator would close the stream
        assert next(lines).startswith("data: {")
        text = metrics(server)
        assert metric_value(text, "poise:time_to_first_token_seconds_count") == 1
        assert metric_value(text, "poise:request_prefill_time_seconds_count") == 1
        assert metric_value(text, "poise:request_success_total") == 0  # still running
        # Inter-token gaps are observed as tokens come, not at the end.
        wait_for(
            lambda: metric_value(metrics(server), "poise:inter_token_latency_seconds_count") >= 3
        )
        assert metric_value(metrics(server), "poise:request_success_total") == 0


def test_an_aborted_request_with_a_first_token_is_in_the_ttft_histogram(
    smol_tokenizer: Any,
) -> None:
    with slow_server(smol_tokenizer) as server:
        with _stream(server, [9, 10, 11], 500) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break  # leave after the first token: the server aborts the request
        wait_for(
            lambda: (
                metric_value(
                    metrics(server), "poise:request_success_total", finished_reason="abort"
                )
                == 1
            )
        )
        text = metrics(server)
        assert metric_value(text, "poise:time_to_first_token_seconds_count") == 1
        assert metric_value(text, "poise:e2e_request_latency_seconds_count") == 0  # not served


def test_ttft_parts_add_up_for_every_request() -> None:
    """ingress + queue + prefill compute + first-token scheduling == TTFT, per request, with
    chunked prefills that wait behind each other and arrivals before the engine takes them."""
    clock = VirtualClock()
    cfg = EngineConfig.from_kwargs(
        block_size=4, max_num_batched_tokens=16, max_num_seqs=4, enable_chunked_prefill=True
    )
    core = EngineCore(
        cfg, ClockedExecutor(clock), num_kv_blocks=256, max_model_len=512, clock=clock
    )
    for i in range(6):
        clock.advance(0.5)
        core.add_request(
            f"r{i}",
            list(range(1, 20 + 7 * i)),
            SamplingParams(max_tokens=3),
            arrival_time=clock.now() - 0.1 * i,
        )
    seen = {}
    while core.has_unfinished_requests():
        clock.advance(0.25)  # between steps: the gaps a chunked prompt waits through
        deltas, _ = core.step()
        for d in deltas:
            if d.times is not None and d.times.first_token is not None:
                seen[d.request_id] = derive(d.times)
    assert len(seen) == 6
    for rid, m in seen.items():
        assert None not in (
            m.ttft,
            m.ingress_time,
            m.queue_time,
            m.prefill_compute,
            m.first_token_sched,
        ), rid
        parts = m.ingress_time + m.queue_time + m.prefill_compute + m.first_token_sched  # type: ignore[operator]
        assert parts == pytest.approx(m.ttft, abs=1e-9), rid
    assert all(m.prefill_compute > 0 for m in seen.values())  # type: ignore[operator]
    assert any(m.first_token_sched > 0 for m in seen.values())  # type: ignore[operator]
    assert any(m.ingress_time > 0 for m in seen.values())  # type: ignore[operator]


def test_ttft_part_histograms_sum_to_the_ttft_histogram(smol_tokenizer: Any) -> None:
    with slow_server(smol_tokenizer, delay_s=0.005, max_num_batched_tokens=32) as server:
        for n in (40, 70, 5):
            body = {"model": "fake", "prompt": list(range(100, 100 + n)), "max_tokens": 2}
            assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 200
        text = metrics(server)
        parts = sum(
            metric_value(text, f"poise:{name}_sum")
            for name in (
                "request_ingress_time_seconds",
                "request_queue_time_seconds",
                "request_prefill_compute_seconds",
                "request_first_token_scheduling_seconds",
            )
        )
        ttft = metric_value(text, "poise:time_to_first_token_seconds_sum")
        assert ttft > 0 and parts == pytest.approx(ttft, rel=1e-6)
        assert metric_value(text, "poise:step_prefill_requests_count") > 0
        assert metric_value(text, "poise:step_token_budget_utilization_count") > 0


def test_prefix_cache_counters_move_when_a_prompt_repeats(smol_tokenizer: Any) -> None:
    with slow_server(smol_tokenizer, delay_s=0.0, enable_prefix_caching=True) as server:
        body = {"model": "fake", "prompt": list(range(200, 264)), "max_tokens": 2}
        assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 200
        first = metrics(server)
        assert metric_value(first, "poise:prefix_cache_requests_total", result="miss") == 1
        assert metric_value(first, "poise:prefix_cache_requests_total", result="hit") == 0
        assert metric_value(first, "poise:prefix_cache_queries_total") == 64
        assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 200
        second = metrics(server)
        assert metric_value(second, "poise:prefix_cache_requests_total", result="hit") == 1
        assert metric_value(second, "poise:prefix_cache_hits_total") == 48  # 3 of 4 blocks
        assert metric_value(second, "poise:prefix_cache_queries_total") == 128


def test_in_flight_hits_are_counted_and_reported_as_cached_tokens(smol_tokenizer: Any) -> None:
    """Two identical prompts sent together: the second waits for the first's prefill (8 of
    its 16-token chunks) and reports the blocks it computed as cached tokens."""
    from concurrent.futures import ThreadPoolExecutor

    with slow_server(
        smol_tokenizer,
        delay_s=0.05,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
    ) as server:
        body = {"model": "fake", "prompt": list(range(300, 430)), "max_tokens": 2}

        def post(_: int) -> Any:
            return httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).json()

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(post, range(2)))
        cached = sorted(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
        assert cached == [0, 128], cached  # 130 tokens: 8 full blocks before the last token
        text = metrics(server)
        inflight = metric_value(text, "poise:prefix_cache_inflight_hits_total")
        assert 0 < inflight <= 128  # what the leader wrote after the follower arrived
        assert metric_value(text, "poise:prefix_cache_hits_total") == 128
        assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]


def test_log_requests_writes_one_json_line_per_request_without_the_prompt(
    smol_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="poise.requests")
    with slow_server(smol_tokenizer, delay_s=0.0, log_requests=True) as server:
        body = {"model": "fake", "prompt": "a secret prompt", "max_tokens": 3}
        assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 200
        wait_for(lambda: any(r.name == "poise.requests" for r in caplog.records))
    lines = [r.getMessage() for r in caplog.records if r.name == "poise.requests"]
    assert len(lines) == 1 and "secret" not in lines[0]
    record = json.loads(lines[0].split(" ", 2)[2])
    assert record["id"].startswith("cmpl-") and record["class"] == "interactive"
    assert record["output_tokens"] == 3 and record["finish_reason"] == "length"
    assert record["prompt_tokens"] > 0 and record["ttft_ms"] > 0 and record["tpot_ms"] >= 0
    parts = ("ingress_ms", "queue_ms", "prefill_compute_ms", "first_token_sched_ms")
    assert sum(record[k] for k in parts) == pytest.approx(record["ttft_ms"], abs=0.01)
