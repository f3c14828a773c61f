"""Hostile input that would cost the server memory or tokenizer time (issue 20, item 1): a
body too large to hold, a prompt too long to tokenize, more text than the tokenizer queue
takes; each refused before it costs anything, and the event loop free while the tokenizer
works. Each test starts its own in-process server (limits_server.py) so that it can set its
limits, swap its tokenizer or measure its memory.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.limits_server import (
    MAX_MODEL_LEN,
    assert_healthy,
    chat,
    limits_server,
    openai_error,
    post_body,
)


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key}")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc")
def test_a_50_mb_body_is_refused_in_seconds_without_growing_memory(smol_tokenizer: Any) -> None:
    """The default limit: 413 quickly, and this process's peak RSS (server and client) flat.

    Writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current RSS, so the peak
    read afterwards is the peak of these two requests alone."""
    messages = [{"role": "user", "content": "word " * 10_000_000}]  # 50 MB
    body = json.dumps({"messages": messages, "max_tokens": 4}).encode()
    mib = 1 << 20
    with limits_server(smol_tokenizer) as server:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_bytes("VmHWM")
        start = time.monotonic()
        sized = post_body(server, "/v1/chat/completions", body)
        pieces = (body[i : i + mib] for i in range(0, len(body), mib))  # no Content-Length
        chunked = post_body(server, "/v1/chat/completions", pieces)  # type: ignore[arg-type]
        elapsed = time.monotonic() - start
        grown = _status_bytes("VmHWM") - before
        for r in (sized, chunked):
            assert "--max-request-body-bytes" in openai_error(r, 413)["message"]
        assert grown < 300 * mib, f"peak RSS grew by {grown / mib:.0f} MiB"
        assert elapsed < 20, elapsed  # today: 131 s; generous for a loaded 2-core machine
        assert_healthy(server)


class CountingTokenizer:
    """The real tokenizer, counting (and optionally slowing) the calls that tokenize."""

    def __init__(self, inner: Any, delay_s: float = 0.0) -> None:
        self._inner = inner
        self.delay_s = delay_s
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        time.sleep(self.delay_s)
        return self._inner.encode(*args, **kwargs)


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(
    smol_tokenizer: Any,
) -> None:
    with limits_server(smol_tokenizer) as server:
        counting = CountingTokenizer(smol_tokenizer)
        server.state.generator.tokenizer = counting
        bound = server.state.generator.prompt_bound.max_chars
        assert bound == MAX_MODEL_LEN * 81  # SmolLM2's longest vocabulary entry
        text = "é" * (bound + 1)
        for r, param in (
            (chat(server, messages=[{"role": "user", "content": text}]), "messages"),
            (
                httpx.post(
                    server.base_url + "/v1/completions",
                    json={"prompt": text, "max_tokens": 1},
                    timeout=30,
                ),
                "prompt",
            ),
        ):
            err = openai_error(r, 400)
            assert err["param"] == param and "characters" in err["message"]
            assert str(MAX_MODEL_LEN) in err["message"]
        assert counting.calls == 0
        assert_healthy(server)
        assert counting.calls == 1


def test_tokenizer_queue_bound_answers_429_instead_of_queueing(smol_tokenizer: Any) -> None:
    with limits_server(smol_tokenizer, max_tokenizer_queue_chars=1500) as server:
        slow = CountingTokenizer(smol_tokenizer, delay_s=1.5)
        server.state.generator.tokenizer = slow
        queue = server.state.generator.tokenizer_queue
        url = server.base_url + "/v1/completions"
        body = {"prompt": "a b " * 250, "max_tokens": 1}  # 1000 characters each
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, url, json=body, timeout=30)
            deadline = time.monotonic() + 10
            while queue.pending_chars == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            second = httpx.post(url, json=body, timeout=30)
            err = openai_error(second, 429)
            assert "max_tokenizer_queue_chars=1500" in err["message"]
            assert err["code"] == "tokenizer_queue_full" and err["type"] == "rate_limit_error"
            assert int(second.headers["Retry-After"]) >= 1
            assert first.result().status_code == 200  # a request alone always gets in
        assert queue.pending_chars == 0
        assert httpx.post(url, json=body, timeout=30).status_code == 200


def test_event_loop_stays_responsive_while_a_long_prompt_tokenizes(smol_tokenizer: Any) -> None:
    """Tokenizer work runs on its own thread: /health answers while it runs."""
    with limits_server(smol_tokenizer) as server:
        server.state.generator.tokenizer = CountingTokenizer(smol_tokenizer, delay_s=2.0)
        url = server.base_url + "/v1/completions"
        result: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: result.append(httpx.post(url, json={"prompt": "hi"}, timeout=30))
        )
        worker.start()
        time.sleep(0.3)
        assert worker.is_alive()
        assert httpx.get(server.base_url + "/health", timeout=1.0).status_code == 200
        worker.join()
        assert result[0].status_code == 200
