"""The HTTP side of benchmarks/serving.py (and serving_overhead.py): the `poise serve`
subprocess, the streaming closed-loop client, the /metrics scrape of the server's CPU time,
and a /dashboard/feed reader."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
from serving_report import Cell

REPO = Path(__file__).resolve().parents[1]


async def _one(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, model: str
) -> tuple[float | None, int]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in obj.get("choices", [])):
                first = time.perf_counter() - sent
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    return first, tokens


async def run_http(
    base: str, model: str, reqs: list[tuple[str, str]], c: int, max_tokens: int
) -> Cell:
    url = base + "/v1/chat/completions"
    queue = list(enumerate(reqs))
    ttft: dict[str, list[float]] = {"short": [], "long": []}
    total = 0
    conn = aiohttp.TCPConnector(limit=c + 4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(3600)) as s:

        async def worker() -> None:
            nonlocal total
            while queue:
                _, (cls, prompt) = queue.pop(0)
                first, n = await _one(s, url, prompt, max_tokens, model)
                total += n
                if first is not None:
                    ttft[cls].append(first)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        seconds = time.perf_counter() - start
    return Cell("http", c, len(reqs), total, seconds, ttft)


@contextlib.contextmanager
def page_reader(base: str) -> Iterator[None]:
    """A /dashboard/feed reader (what an open live page costs the server) while in the block."""
    stop = threading.Event()

    def read() -> None:
        with httpx.stream("GET", base + "/dashboard/feed", timeout=None) as resp:
            for _ in resp.iter_lines():
                if stop.is_set():
                    return

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=3)


def scrape(base: str) -> dict[str, float]:
    names = {
        "engine_thread": "poise:engine_thread_cpu_seconds",
        "loop_thread": "poise:event_loop_thread_cpu_seconds",
        "process": "process_cpu_seconds_total",
        "steps": "poise:step_duration_seconds_sum",
        "step_count": "poise:step_duration_seconds_count",
        # The server's own split of each request's TTFT (poise/serving/metrics.py), summed
        # over traffic classes: which phase a slower TTFT came from.
        **{
            f"{phase}_{part}": f"poise:request_{phase}_seconds_{part}"
            for phase in ("ingress_time", "queue_time", "prefill_time", "prefill_compute")
            for part in ("sum", "count")
        },
    }
    out: dict[str, float] = {}
    text = httpx.get(base + "/metrics", timeout=30).text
    for key, name in names.items():
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def start_server(
    args: argparse.Namespace, port: int, kv_cache_dtype: str = "auto"
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "poise",
        "serve",
        *([args.model] if args.model else []),
        "--kv-cache-dtype",
        kv_cache_dtype,
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--served-model-name",
        "bench",
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--log-interval",
        "0",
        *(["--torch-threads", str(args.torch_threads)] if args.torch_threads > 0 else []),
    ]
    log = open(args.server_log, "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited; see {args.server_log}")
        time.sleep(0.25)
    raise SystemExit("server did not come up")
