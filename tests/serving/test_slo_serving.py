"""Priorities, traffic classes, predictive admission and per-class metrics over HTTP."""

from __future__ import annotations

from typing import Any

import httpx

from tests.serving.conftest import metric_value, post_all_at_once
from tests.serving.test_faults import _server

CLASSES = "chat:ttft_p95_ms=60000,tpot_p50_ms=60000,share=0.5;tight:ttft_p95_ms=30,share=0.5"


def test_priority_class_and_slo_fields(smol_tokenizer: Any) -> None:
    server, _ = _server(smol_tokenizer, scheduling_policy="slo", traffic_classes=CLASSES)
    with server:
        url = server.base_url + "/v1/completions"
        base = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        ok = httpx.post(url, json={**base, "priority": 2, "class": "chat", "ttft_slo_ms": 9000})
        assert ok.status_code == 200, ok.text
        chat = server.base_url + "/v1/chat/completions"
        msg = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -1}
        r = httpx.post(chat, json=msg, headers={"X-Poise-Class": "chat"})
        assert r.status_code == 200, r.text
        bad = httpx.post(url, json={**base, "class": "batch"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "class" and "chat, tight" in bad.text
        bad = httpx.post(url, json={**base, "priority": "high"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        bad = httpx.post(url, json={**base, "ttft_slo_ms": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttft_slo_ms"
        text = httpx.get(server.base_url + "/metrics").text
        # Both requests were class "chat" (one by field, one by header); TTFT observed by class.
        assert (
            metric_value(text, "poise:time_to_first_token_seconds_count", **{"class": "chat"}) == 2
        )
        assert metric_value(text, "poise:slo_ttft_total", result="met", **{"class": "chat"}) == 2
        assert metric_value(text, "poise:slo_tpot_total", result="met", **{"class": "chat"}) == 2
        assert metric_value(text, "poise:goodput_tokens_total", **{"class": "chat"}) == 5


def test_predictive_admission_answers_429_with_a_computed_retry_after(smol_tokenizer: Any) -> None:
    server, executor = _server(
        smol_tokenizer,
        traffic_classes=CLASSES,
        admission_control="predictive",
        admission_margin=0.0,
        max_num_batched_tokens=32,
        max_num_seqs=4,
    )
    executor.delay_s = 0.02
    with server:
        bodies = [
            {
                "prompt": [5, 6] * 30 + [i + 10],
                "max_tokens": 8,
                "ignore_eos": True,
                "class": "tight",
            }
            for i in range(16)
        ]
        responses = post_all_at_once(server.base_url + "/v1/completions", bodies)
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and codes.count(429) > 0, codes
        for r in responses:
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "slo"
                assert "predicted time to first token" in r.json()["error"]["message"]
                assert int(r.headers["Retry-After"]) >= 1
        text = httpx.get(server.base_url + "/metrics").text
        assert metric_value(text, "poise:requests_rejected_total", reason="slo") == codes.count(429)


def test_class_preemptions_and_token_budget_metrics() -> None:
    from types import MappingProxyType

    from poise.engine.state import EngineState
    from poise.serving.metrics import ServingMetrics

    m = ServingMetrics("m")
    state = EngineState(preemptions_by_class=MappingProxyType({"short": 2}), token_budget=256)
    m.track_engine_state(lambda: state)  # read at each scrape: the latest snapshot
    state = EngineState(  # the engine's running totals are exposed as they are
        num_preemptions=4,
        preemptions_by_class=MappingProxyType({"short": 3, "long": 1}),
        token_budget=512,
        paced_prefill_tokens=MappingProxyType({"long": 220}),
    )
    text = m.render().decode()
    assert metric_value(text, "poise:class_preemptions_total", **{"class": "short"}) == 3
    assert metric_value(text, "poise:class_preemptions_total", **{"class": "long"}) == 1
    assert metric_value(text, "poise:num_preemptions_total") == 4
    assert metric_value(text, "poise:token_budget") == 512
    assert metric_value(text, "poise:paced_prefill_tokens", **{"class": "long"}) == 220


def test_dynamic_batching_serves_after_its_delay_without_spinning(smol_tokenizer: Any) -> None:
    """The engine thread sleeps while a dynamic batch fills (EngineCore.ready_in_s), then
    serves it; a lone request waits the delay, not forever and not in a busy loop."""
    import time

    server, _ = _server(smol_tokenizer, scheduling_policy="dynamic", max_batch_delay_ms=1000.0)
    with server:
        t0 = time.perf_counter()
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True},
        )
        waited = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        assert waited >= 1.0  # held for company first
        # Spinning through the delay would be thousands of empty steps.
        text = httpx.get(server.base_url + "/metrics").text
        cpu = metric_value(text, "poise:engine_thread_cpu_seconds")
        assert cpu is not None and cpu < 0.2, cpu
