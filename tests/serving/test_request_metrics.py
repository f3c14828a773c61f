"""Per-request timing in responses (vLLM's --enable-per-request-metrics / include_metrics),
through the official openai client, streamed and not, around the deterministic fake executor."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from poise.config import EngineConfig
from poise.engine.core import EngineCore
from poise.serving.server import build_state
from poise.serving.settings import ServerSettings
from poise.text import eos_token_ids
from tests.serving.conftest import InProcessServer
from tests.serving.test_observability import SlowExecutor

VLLM_KEYS = {
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
}
PARTS = ("ingress_time_ms", "queue_time_ms", "prefill_compute_ms", "first_token_sched_ms")


def _server(tokenizer: Any, enabled: bool) -> InProcessServer:
    vocab = len(tokenizer)
    cfg = EngineConfig.from_kwargs(block_size=16, enable_prefix_caching=True)
    core = EngineCore(
        cfg,
        SlowExecutor(vocab, 16, 0.01),
        num_kv_blocks=256,
        max_model_len=1024,
        vocab_size=vocab,
        eos_token_ids=eos_token_ids(tokenizer),
    )
    settings = ServerSettings(enable_per_request_metrics=enabled)
    state = build_state(core, tokenizer, model_name="fake", vocab_size=vocab, settings=settings)
    return InProcessServer(state)


@pytest.fixture(scope="module")
def server(smol_tokenizer: Any) -> Any:
    with _server(smol_tokenizer, enabled=True) as s:
        yield s


def _client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def _check(m: dict[str, Any], n_tokens: int) -> None:
    assert set(m) >= VLLM_KEYS
    assert m["time_to_first_token_ms"] > 0
    # TTFT is its parts; generation time is TTFT plus the decode; the rate is over it.
    assert sum(m[k] for k in PARTS) == pytest.approx(m["time_to_first_token_ms"], abs=0.01)
    assert m["prefill_time_ms"] == pytest.approx(
        m["prefill_compute_ms"] + m["first_token_sched_ms"], abs=0.01
    )
    assert m["generation_time_ms"] == pytest.approx(
        m["time_to_first_token_ms"] + m["decode_time_ms"], abs=0.01
    )
    assert m["tokens_per_second"] == pytest.approx(
        n_tokens / (m["generation_time_ms"] / 1000), rel=1e-3
    )
    # The fake executor sleeps 10 ms a step: each gap between tokens is a step or more.
    assert m["mean_itl_ms"] >= 9.0 and m["tpot_ms"] == pytest.approx(m["mean_itl_ms"], abs=0.01)


def test_a_response_carries_its_own_timing(server: InProcessServer) -> None:
    client = _client(server)
    resp = client.completions.create(
        model="fake",
        prompt=list(range(300, 340)),
        max_tokens=6,
        extra_body={"include_metrics": True},
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 6
    m = resp.model_extra["metrics"]  # type: ignore[index]
    _check(m, 6)
    assert m["num_cached_tokens"] == 0 and m["num_preemptions"] == 0
    again = client.completions.create(
        model="fake",
        prompt=list(range(300, 340)),
        max_tokens=6,
        extra_body={"include_metrics": True},
    )
    assert again.model_extra["metrics"]["num_cached_tokens"] == 32  # type: ignore[index]
    chat = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_body={"include_metrics": True, "ignore_eos": True},
    )
    _check(chat.model_extra["metrics"], 4)  # type: ignore[index]


def test_no_metrics_unless_asked(server: InProcessServer) -> None:
    body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 2}
    resp = httpx.post(server.base_url + "/v1/completions", json=body)
    assert resp.status_code == 200 and "metrics" not in resp.json()
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body | {"stream": True}
    ) as stream:
        assert not any("metrics" in line for line in stream.iter_lines())


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_stream_carries_timing_on_its_last_chunk(
    server: InProcessServer, include_usage: bool
) -> None:
    client = _client(server)
    chunks = list(
        client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": include_usage},
            extra_body={"include_metrics": True, "ignore_eos": True},
        )
    )
    with_metrics = [i for i, c in enumerate(chunks) if (c.model_extra or {}).get("metrics")]
    assert with_metrics == [len(chunks) - 1]  # the last chunk, and only it
    last = chunks[-1]
    if include_usage:
        assert last.choices == [] and last.usage is not None
    else:
        assert last.choices[0].finish_reason == "length"
    _check(last.model_extra["metrics"], 5)  # type: ignore[index]


def test_asking_a_server_without_the_flag_is_a_400(smol_tokenizer: Any) -> None:
    with _server(smol_tokenizer, enabled=False) as server:
        client = _client(server)
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(
                model="fake", prompt="hi", max_tokens=2, extra_body={"include_metrics": True}
            )
        body = err.value.body
        assert isinstance(body, dict) and body["param"] == "include_metrics"
        assert "--enable-per-request-metrics" in body["message"]
        ok = client.completions.create(model="fake", prompt="hi", max_tokens=2)
        assert ok.usage is not None and ok.usage.completion_tokens >= 1
