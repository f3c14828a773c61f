"""Shutdown: requests still running when the grace period ends, or at a second SIGTERM, are cut
visibly (an error event and ``[DONE]`` on a stream, a JSON 503 otherwise), never silently;
fractional periods hold. The grace period runs in process (fake executor, real tokenizer);
the second SIGTERM goes to a real `poise serve` subprocess (tiny random Llama)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from poise.config import EngineConfig
from poise.engine.core import EngineCore
from poise.serving.server import build_state
from poise.serving.settings import ServerSettings
from tests.serving.conftest import InProcessServer, ServerProcess, metric_value
from tests.unit.fake_executor import FakeExecutor


class _InFlight:
    """A long stream (chat) and a long non-streaming completion, each on its own thread."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.lines: list[str] = []
        self.stream_ended_at = 0.0
        self.response: httpx.Response | None = None
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._post)]
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 60
        while self._running() < 2:
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.05)

    def _running(self) -> float:
        text = httpx.get(self.server.base_url + "/metrics", timeout=5).text
        return metric_value(text, "poise:num_requests_running")

    def _stream(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1900,
            "ignore_eos": True,
            "stream": True,
        }
        url = self.server.base_url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            self.lines.extend(line for line in r.iter_lines() if line.startswith("data: "))
        self.stream_ended_at = time.monotonic()

    def _post(self) -> None:
        body = {"prompt": "hello", "max_tokens": 1900, "ignore_eos": True}
        self.response = httpx.post(self.server.base_url + "/v1/completions", json=body, timeout=60)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=60)

    def assert_cut_visibly(self) -> None:
        assert self.lines[-1] == "data: [DONE]", self.lines[-3:]
        error = json.loads(self.lines[-2][len("data: ") :])["error"]
        assert error["code"] == 503 and error["type"] == "service_unavailable", error
        assert "shutting down" in error["message"]
        # No chunk claimed the answer was complete.
        finishes = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in self.lines[:-2]]
        assert finishes and not any(finishes), finishes[-3:]
        assert self.response is not None and self.response.status_code == 503
        assert self.response.headers["content-type"] == "application/json"
        assert self.response.json()["error"]["code"] == "server_shutting_down"


def test_a_fractional_grace_period_ends_with_visible_cuts(smol_tokenizer: Any) -> None:
    vocab = len(smol_tokenizer)
    cfg = EngineConfig.from_kwargs(block_size=16)
    executor = FakeExecutor(vocab, 16)
    core = EngineCore(cfg, _Slow(executor), num_kv_blocks=512, max_model_len=2048, vocab_size=vocab)
    state = build_state(core, smol_tokenizer, model_name="fake", vocab_size=vocab)
    server = InProcessServer(state, ServerSettings(shutdown_grace_s=0.5))
    with server:
        flight = _InFlight(server)
        sent = time.monotonic()
        server.server.should_exit = True  # what the first SIGTERM does
        flight.join()
    waited = flight.stream_ended_at - sent
    flight.assert_cut_visibly()
    assert 0.45 <= waited < 10, waited  # 0.5 s honoured: not truncated to 0
    assert core.scheduler.kv_cache_usage == 0 and not core.has_unfinished_requests()


class _Slow:
    """A step of 10 ms, so that 1,900 tokens take far longer than the grace period."""

    def __init__(self, inner: FakeExecutor) -> None:
        self.inner = inner

    def execute(self, scheduler_output: Any) -> Any:
        time.sleep(0.01)
        return self.inner.execute(scheduler_output)


def test_a_second_sigterm_cuts_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = [
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        "8MiB",
        "--shutdown-grace-period",
        "600",
    ]
    server = ServerProcess(args, tmp_path / "server.log").wait_ready()
    try:
        flight = _InFlight(server)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        flight.join()
        flight.assert_cut_visibly()
        assert flight.stream_ended_at - sent < 10
        assert server.proc.wait(timeout=30) == 0
        log: Any = server.log_path.read_text()
        assert "second signal" in log, log[-2000:]
    finally:
        server.stop()
