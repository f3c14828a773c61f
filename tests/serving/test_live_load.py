"""Acceptance tests against one live `poise serve` subprocess (tiny random Llama, real SmolLM2
tokenizer), through the official openai client and raw HTTP: 64 concurrent streams,
disconnects, metrics, SIGTERM's drain (live_server.py: the same server as test_live.py's).

One server for the module; tests that read metric deltas run their traffic sequentially.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.serving.conftest import ServerProcess, metric_value
from tests.serving.live_server import live_server, metrics_text


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with live_server(tiny_model_dir, tmp_path_factory.mktemp("live")) as proc:
        yield proc


def test_64_concurrent_streams_all_complete_correctly(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    prompts = [f"Request class {i}: summarize the log." for i in range(4)]
    expected = {
        p: client.completions.create(
            model="tiny", prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in prompts
    }
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)

    async def one(i: int) -> tuple[str, str, int]:
        prompt = prompts[i % 4]
        stream = await aclient.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, n = "", 0
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        return prompt, text, n

    async def all_of_them() -> list[tuple[str, str, int]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    assert len(results) == 64
    for prompt, text, n in results:
        assert n == 16 and text == expected[prompt]


def _wait_for(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_disconnecting_20_streams_and_3_waiters_frees_the_kv_cache(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    aborts_before = metric_value(
        metrics_text(server), "poise:request_success_total", finished_reason="abort"
    )

    async def start_and_leave(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"long story {i}", "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with http.stream("POST", server.base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    return  # leaving the block closes the connection mid-generation

    async def give_up_waiting(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"never mind {i}", "max_tokens": 400, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            await http.post(server.base_url + "/v1/completions", json=body, timeout=0.3)

    async def run() -> None:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            await asyncio.gather(
                *(start_and_leave(http, i) for i in range(20)),
                *(give_up_waiting(http, i) for i in range(3)),
            )

    asyncio.run(run())

    def drained() -> bool:
        text = metrics_text(server)
        return (
            metric_value(text, "poise:kv_cache_usage_perc") == 0
            and metric_value(text, "poise:num_requests_running") == 0
            and metric_value(text, "poise:request_success_total", finished_reason="abort")
            >= aborts_before + 23
        )

    _wait_for(drained)
    out = client.completions.create(model="tiny", prompt="still there?", max_tokens=3)
    assert out.usage is not None and out.usage.completion_tokens == 3


def test_metrics_move_and_histograms_count_served_requests(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    names = (
        "poise:e2e_request_latency_seconds_count",
        "poise:time_to_first_token_seconds_count",
        "poise:request_queue_time_seconds_count",
        "poise:generation_tokens_total",
        "poise:prompt_tokens_total",
    )
    before = {n: metric_value(metrics_text(server), n) for n in names}
    prompt_tokens = completion_tokens = 0
    for i in range(5):
        out = client.completions.create(
            model="tiny", prompt=f"metrics {i}", max_tokens=5 + i, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None
        prompt_tokens += out.usage.prompt_tokens
        completion_tokens += out.usage.completion_tokens
    _wait_for(lambda: metric_value(metrics_text(server), names[0]) >= before[names[0]] + 5)
    after = {n: metric_value(metrics_text(server), n) for n in names}
    assert after[names[0]] - before[names[0]] == 5
    assert after[names[1]] - before[names[1]] == 5
    assert after[names[2]] - before[names[2]] == 5
    assert after["poise:generation_tokens_total"] - before["poise:generation_tokens_total"] == (
        completion_tokens
    )
    assert after["poise:prompt_tokens_total"] - before["poise:prompt_tokens_total"] == prompt_tokens
    text = metrics_text(server)
    assert metric_value(text, "poise:step_duration_seconds_count") > 0
    assert metric_value(text, "poise:step_decode_tokens_sum") > 0
    assert metric_value(text, "poise:request_success_total", finished_reason="length") >= 5


def test_sigterm_stops_accepting_finishes_in_flight_and_exits_0(server: ServerProcess) -> None:
    """Last in the module: it shuts the shared server down."""
    lines: list[str] = []

    def stream() -> None:
        body = {
            "prompt": "drain me",
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        url = server.base_url + "/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=0.3) as r:
            lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=stream)
    thread.start()
    _wait_for(lambda: metric_value(metrics_text(server), "poise:num_requests_running") >= 1)
    server.proc.send_signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            httpx.get(server.base_url + "/health", timeout=1)
        except httpx.TransportError:
            return True
        return False

    _wait_for(refused)
    thread.join(timeout=120)
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][len("data: ") :])["usage"]
    assert usage["completion_tokens"] == 200
    assert server.proc.wait(timeout=60) == 0
