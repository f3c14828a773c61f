"""The periodic engine line (vLLM's 'Avg prompt throughput ... Running ... Waiting ...'): what a
busy engine logs every --log-interval seconds, from the real AsyncEngine around the fake model."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import pytest

from poise.config import EngineConfig
from poise.engine.core import EngineCore
from poise.serving.server import build_state
from poise.serving.settings import ServerSettings
from poise.text import eos_token_ids
from tests.serving.conftest import InProcessServer
from tests.serving.test_observability import SlowExecutor

LINE = re.compile(
    r"prompt (?P<prompt>[\d.]+) tok/s, generation (?P<gen>[\d.]+) tok/s, running (?P<run>\d+), "
    r"waiting (?P<wait>\d+), KV (?P<kv>[\d.]+)%, prefix cache hits (?P<hits>[\d.]+)%, "
    r"token budget (?P<budget>\d+), preemptions (?P<pre>\d+)"
)


def test_a_busy_engine_logs_throughput_queue_kv_cache_hits_and_budget(
    smol_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="poise.serving.async_engine")
    vocab = len(smol_tokenizer)
    cfg = EngineConfig.from_kwargs(
        block_size=16, enable_prefix_caching=True, max_num_batched_tokens=256
    )
    core = EngineCore(
        cfg,
        SlowExecutor(vocab, 16, 0.01),
        num_kv_blocks=256,
        max_model_len=1024,
        vocab_size=vocab,
        eos_token_ids=eos_token_ids(smol_tokenizer),
    )
    settings = ServerSettings(log_interval_s=0.05)
    state = build_state(
        core, smol_tokenizer, model_name="fake", vocab_size=vocab, settings=settings
    )
    body = {"model": "fake", "prompt": list(range(400, 464)), "max_tokens": 30}
    with InProcessServer(state) as server:
        for _ in range(2):  # the second one hits the first one's cached blocks
            assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 200
    lines = [LINE.search(r.getMessage()) for r in caplog.records]
    found = [m for m in lines if m is not None]
    assert found, "no periodic engine line"
    assert any(float(m["gen"]) > 0 for m in found)
    assert all(int(m["budget"]) == 256 for m in found)
    assert float(found[-1]["hits"]) > 0  # 48 of the 128 prompt tokens looked up were cached
