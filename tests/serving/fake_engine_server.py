"""The app, AsyncEngine and SmolLM2 tokenizer around the scheduler tests' fake executor, in this
process, and the probes the lifecycle and load tests read it with (test_lifecycle.py,
test_load.py)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import httpx

from poise.config import EngineConfig
from poise.core.outputs import ModelRunnerOutput, SchedulerOutput
from poise.engine.core import EngineCore
from poise.serving.server import build_state
from poise.serving.settings import ServerSettings
from tests.serving.conftest import InProcessServer, metric_value
from tests.unit.fake_executor import FakeExecutor


class ThreadKilled(BaseException):
    """Not an Exception: what the engine thread's ordinary error handling does not catch."""


class Executor(FakeExecutor):
    """The fake executor, slowed so that requests overlap; ``kill`` ends the engine thread."""

    def __init__(self, vocab: int) -> None:
        super().__init__(vocab, 16)
        self.delay_s = 0.002
        self.kill = False

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self.delay_s)
        if self.kill:
            raise ThreadKilled("the engine thread is gone")
        out = super().execute(scheduler_output)
        self.steps.clear()  # the fake's record of every step would grow for the whole soak
        return out


def fake_server(
    tokenizer: Any, settings: ServerSettings | None = None, **engine: Any
) -> tuple[InProcessServer, Executor]:
    vocab = len(tokenizer)
    executor = Executor(vocab)
    core = EngineCore(
        EngineConfig.from_kwargs(block_size=16, **engine),
        executor,
        num_kv_blocks=512,
        max_model_len=2048,
        vocab_size=vocab,
    )
    state = build_state(core, tokenizer, model_name="fake", vocab_size=vocab)
    return InProcessServer(state, settings), executor


def gauge(server: InProcessServer, name: str) -> float:
    return metric_value(httpx.get(server.base_url + "/metrics", timeout=10).text, name)


def wait(cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def tasks(server: InProcessServer) -> int:
    """Tasks alive on the server's event loop."""
    loop = server.state.engine._loop

    async def count() -> int:
        return len(asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), loop).result(timeout=10)


def assert_left_nothing(server: InProcessServer, threads: int, num_tasks: int) -> None:
    """Nothing running or waiting, no KV block, task or thread beyond those given, and the next
    request served."""
    core = server.state.engine.core
    wait(
        lambda: (
            gauge(server, "poise:num_requests_running") == 0
            and gauge(server, "poise:num_requests_waiting") == 0
        )
    )
    wait(lambda: core.scheduler.kv_cache_usage == 0 and tasks(server) <= num_tasks)
    assert server.state.engine.num_in_flight == 0
    assert threading.active_count() <= threads
    r = httpx.post(
        server.base_url + "/v1/completions",
        timeout=30,
        json={"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
