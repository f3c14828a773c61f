"""Failure paths with a fake executor (no model): engine exceptions, dead engine, overload.

The executor is the scheduler tests' deterministic fake, wrapped to raise or to be slow, behind
the real EngineCore, AsyncEngine and app, with the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from poise.config import EngineConfig
from poise.core.outputs import ModelRunnerOutput, SchedulerOutput
from poise.engine.core import EngineCore
from poise.serving.server import build_state
from poise.text import eos_token_ids
from tests.serving.conftest import InProcessServer, metric_value, post_all_at_once
from tests.unit.fake_executor import FakeExecutor

POISON = 4242  # a prompt token that makes the step running it raise


class FaultyExecutor(FakeExecutor):
    def __init__(self, vocab: int, block_size: int) -> None:
        super().__init__(vocab, block_size)
        self.always_fail = False
        self.delay_s = 0.0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.always_fail or any(POISON in s.token_ids for s in scheduler_output.scheduled):
            raise RuntimeError("injected fault")
        return super().execute(scheduler_output)


def _server(
    tokenizer: Any, num_kv_blocks: int = 128, **engine_kwargs: Any
) -> tuple[InProcessServer, FaultyExecutor]:
    vocab = len(tokenizer)
    cfg = EngineConfig.from_kwargs(block_size=16, **engine_kwargs)
    executor = FaultyExecutor(vocab, 16)
    core = EngineCore(
        cfg,
        executor,
        num_kv_blocks=num_kv_blocks,
        max_model_len=1024,
        vocab_size=vocab,
        eos_token_ids=eos_token_ids(tokenizer),
    )
    state = build_state(core, tokenizer, model_name="fake", vocab_size=vocab)
    return InProcessServer(state), executor


def _client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def test_step_exception_fails_its_requests_and_the_engine_goes_on(smol_tokenizer: Any) -> None:
    server, _ = _server(smol_tokenizer)
    with server:
        client = _client(server)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="fake", prompt=[5, POISON, 6], max_tokens=4)
        assert "injected fault" in info.value.message and "step" in info.value.message
        with pytest.raises(openai.APIError, match="injected fault"):
            for _ in client.completions.create(
                model="fake", prompt=[7, POISON], max_tokens=4, stream=True
            ):
                pass
        health = httpx.get(server.base_url + "/health").json()
        assert health["status"] == "ok" and "injected fault" in health["last_error"]
        ok = client.completions.create(model="fake", prompt=[5, 6], max_tokens=3)
        assert ok.usage is not None and ok.usage.completion_tokens == 3
        text = httpx.get(server.base_url + "/metrics").text
        assert metric_value(text, "poise:engine_errors_total") == 2
        assert metric_value(text, "poise:request_success_total", finished_reason="error") == 2
        assert metric_value(text, "poise:kv_cache_usage_perc") == 0


def test_dead_engine_reports_on_health(smol_tokenizer: Any) -> None:
    server, executor = _server(smol_tokenizer)
    with server:
        executor.always_fail = True
        client = _client(server)
        for _ in range(3):  # max_consecutive_failures
            with pytest.raises(openai.APIStatusError):
                client.completions.create(model="fake", prompt=[5, 6], max_tokens=2)
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503
        assert "injected fault" in health.json()["error"]["message"]
        assert httpx.get(server.base_url + "/ready").status_code == 503
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="fake", prompt=[5, 6], max_tokens=2)
        assert info.value.status_code == 503


def test_flood_against_a_tiny_queue_gets_429_with_retry_after(smol_tokenizer: Any) -> None:
    server, executor = _server(smol_tokenizer, max_num_seqs=2, max_num_queued_requests=2)
    executor.delay_s = 0.01
    with server:
        bodies = [
            {"prompt": [5, 6, i + 10], "max_tokens": 20, "ignore_eos": True} for i in range(24)
        ]
        responses = post_all_at_once(server.base_url + "/v1/completions", bodies)
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(429) > 0 and codes.count(200) >= 4, codes
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 20
        # The openai client parses the 429 too (it raises RateLimitError).
        text = httpx.get(server.base_url + "/metrics").text
        assert metric_value(
            text, "poise:requests_rejected_total", reason="queue_full"
        ) == codes.count(429)


def test_a_burst_fills_the_free_slots_before_the_queue_bound_applies(smol_tokenizer: Any) -> None:
    """64 sequence slots and a queue of 8: 100 requests at once are 72 admitted (the slots plus
    the queue), not the 8-16 of a bound that counted requests the next step would start."""
    server, executor = _server(
        smol_tokenizer, num_kv_blocks=4096, max_num_seqs=64, max_num_queued_requests=8
    )
    executor.delay_s = 0.02  # 50 tokens: each admitted request runs for 1 s or more
    with server:
        url = server.base_url + "/v1/completions"

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                bodies = [
                    {"prompt": [5, 6, i + 10], "max_tokens": 50, "ignore_eos": True}
                    for i in range(100)
                ]
                return list(await asyncio.gather(*(client.post(url, json=b) for b in bodies)))

        codes = [r.status_code for r in asyncio.run(burst())]
    assert set(codes) <= {200, 429}, codes
    # Exactly 72 while none has finished; more only if some finished during the burst.
    assert codes.count(200) >= 72 and codes.count(429) >= 1, codes


def test_prompt_longer_than_the_kv_pool_is_400_naming_the_limit(smol_tokenizer: Any) -> None:
    server, _ = _server(smol_tokenizer, num_kv_blocks=4)  # 64 tokens of KV
    with server:
        with pytest.raises(openai.BadRequestError) as info:
            _client(server).completions.create(model="fake", prompt=list(range(10, 90)))
        message = info.value.body["message"]  # type: ignore[index]
        assert "80 tokens" in message and "KV cache" in message and "64 tokens" in message
