"""A scripted OpenAI-compatible SSE server for bench tests, on 127.0.0.1 in its own thread.

Script per request: the first token event (1 token) at ``ttft``; then events of ``k`` tokens,
``k * tpot`` apart, so the true TPOT is ``tpot`` for every k. Options: a role-only chunk at
stream open, a usage-only chunk ``usage_delay`` after the last token, per-chunk usage when
asked (continuous_usage_stats), strict mode (400 on ignore_eos / stream_options), an EOS
after ``eos_at`` tokens unless ignore_eos. ``/metrics`` exposes poise-style series: running,
waiting, KV usage, a preemption counter (+1 per request) and a TTFT histogram.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Script:
    ttft: float = 0.1
    tpot: float = 0.02
    k: int = 1
    role_chunk: bool = False
    usage_delay: float = 0.0
    usage_chunk: bool = True
    strict: bool = False  # reject ignore_eos / stream_options with 400
    eos_at: int | None = None
    token_text: str = "tok "


@dataclass
class State:
    running: int = 0
    peak_running: int = 0  # most requests in flight at once
    waiting: int = 0
    preemptions: int = 0
    requests: int = 0
    ttfts: list[float] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _chunk(
    content: str | None = None,
    role: bool = False,
    usage: dict[str, int] | None = None,
    finish: str | None = None,
    empty_choices: bool = False,
) -> bytes:
    obj: dict[str, Any] = {"id": "x", "object": "chat.completion.chunk", "model": "mock"}
    if empty_choices:
        obj["choices"] = []
    else:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if content is not None:
            delta["content"] = content
        obj["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class MockServer:
    def __init__(self, script: Script | None = None) -> None:
        self.script = script or Script()
        self.state = State()
        self.port = _free_port()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def chat(self, request: web.Request) -> web.StreamResponse:
        sc, st = self.script, self.state
        body = await request.json()
        st.bodies.append(body)
        if sc.strict and ("ignore_eos" in body or "stream_options" in body):
            return web.json_response({"error": "unknown field"}, status=400)
        t_arrival = time.perf_counter()
        st.requests += 1
        st.preemptions += 1
        st.running += 1
        st.peak_running = max(st.peak_running, st.running)
        n = int(body.get("max_tokens", 16))
        if sc.eos_at is not None and not body.get("ignore_eos"):
            n = min(n, sc.eos_at)
        opts = body.get("stream_options") or {}
        per_chunk = bool(opts.get("continuous_usage_stats"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if sc.role_chunk:
                await resp.write(_chunk(content="", role=True))
            await asyncio.sleep(sc.ttft)
            st.ttfts.append(time.perf_counter() - t_arrival)
            sent = 0
            sizes = [1] + [sc.k] * ((n - 1) // sc.k) + ([(n - 1) % sc.k] if (n - 1) % sc.k else [])
            for j, size in enumerate(s for s in sizes if s > 0):
                if j:
                    await asyncio.sleep(sc.k * sc.tpot)
                sent += size
                usage = {"prompt_tokens": 7, "completion_tokens": sent} if per_chunk else None
                await resp.write(_chunk(sc.token_text * size, usage=usage))
            await resp.write(_chunk(content="", finish="length" if sent == n else "stop"))
            if sc.usage_chunk and opts.get("include_usage"):
                await asyncio.sleep(sc.usage_delay)
                usage = {"prompt_tokens": 7, "completion_tokens": sent, "total_tokens": sent + 7}
                await resp.write(_chunk(usage=usage, empty_choices=True))
            await resp.write(b"data: [DONE]\n\n")
        finally:
            st.running -= 1
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "mock-model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        st = self.state
        lines = [
            "# TYPE poise:num_requests_running gauge",
            f'poise:num_requests_running{{model_name="m"}} {st.running}',
            "# TYPE poise:num_requests_waiting gauge",
            f'poise:num_requests_waiting{{model_name="m"}} {st.waiting}',
            "# TYPE poise:kv_cache_usage_perc gauge",
            f'poise:kv_cache_usage_perc{{model_name="m"}} {min(1.0, 0.1 * st.running)}',
            "# TYPE poise:num_preemptions counter",
            f'poise:num_preemptions_total{{model_name="m"}} {st.preemptions}',
            "# TYPE poise:time_to_first_token_seconds histogram",
        ]
        for le in BUCKETS:
            c = sum(1 for t in st.ttfts if t <= le)
            lines.append(f'poise:time_to_first_token_seconds_bucket{{le="{le}"}} {c}')
        lines.append(f'poise:time_to_first_token_seconds_bucket{{le="+Inf"}} {len(st.ttfts)}')
        lines.append(f"poise:time_to_first_token_seconds_count {len(st.ttfts)}")
        lines.append(f"poise:time_to_first_token_seconds_sum {sum(st.ttfts)}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def start(self) -> MockServer:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self.chat)
            app.router.add_get("/v1/models", self.models)
            app.router.add_get("/metrics", self.metrics)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            self._loop.run_until_complete(site.start())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
