"""The HTTP side: OpenAI-compatible streaming requests timed event by event, the capability
probe, the ``/metrics`` scraper and the event-loop lag monitor.

Timing rules (see stats.py for the definitions):
- ``t_sent`` is taken just before the POST, after any wait for a concurrency slot; the slot
  wait is visible as ``sched_lag`` (intended - sent), never hidden.
- Every SSE line is timestamped when read. A token event is one with generated text (content,
  reasoning or tool-call arguments); role-only, empty and usage-only events are not, so they
  cannot move TTFT or E2E.
- Connection pool unlimited and a 1 MiB read buffer: aiohttp's defaults (100 connections,
  64 KiB) throttle high concurrency and long contexts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from poise.bench.prom import ADAPTERS, Scrape, detect_engine, map_scrape, parse_samples
from poise.bench.stats import RequestRecord

log = logging.getLogger(__name__)
now = time.perf_counter


@dataclass
class ChunkInfo:
    chars: int = 0  # generated characters in this event
    usage_completion: int | None = None
    usage_prompt: int | None = None
    finish_reason: str | None = None


def parse_chunk(obj: dict[str, Any]) -> ChunkInfo:
    """What one chat/completions stream chunk carries."""
    info = ChunkInfo()
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        text = [delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning")]
        text.append(choice.get("text"))  # /v1/completions
        for call in delta.get("tool_calls") or []:
            text.append((call.get("function") or {}).get("arguments"))
        info.chars += sum(len(t) for t in text if isinstance(t, str))
        info.finish_reason = choice.get("finish_reason") or info.finish_reason
    usage = obj.get("usage")
    if isinstance(usage, dict):
        info.usage_completion = usage.get("completion_tokens")
        info.usage_prompt = usage.get("prompt_tokens")
    return info


class StreamTimer:
    """Feeds SSE lines of one response into a RequestRecord."""

    def __init__(self, rec: RequestRecord) -> None:
        self.rec = rec
        self.done = False
        # Completion tokens per continuous-usage report at the last token event.
        self._usage_at_event = 0
        self._continuous = True

    def feed(self, line: bytes, t: float) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return  # comments, event names, blank separators
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        rec = self.rec
        if isinstance(obj, dict) and obj.get("error"):
            # An error event mid-stream (vLLM, poise): the request failed after headers.
            rec.ok, rec.error = False, "stream_error"
            return
        info = parse_chunk(obj)
        if info.usage_prompt is not None:
            rec.usage_prompt_tokens = info.usage_prompt
        if info.finish_reason:
            rec.finish_reason = info.finish_reason
        if info.chars > 0:
            rec.events.append(t)
            rec.event_chars.append(info.chars)
            if info.usage_completion is not None and self._continuous:
                rec.event_tokens.append(info.usage_completion - self._usage_at_event)
                self._usage_at_event = info.usage_completion
            else:
                self._continuous = False
                rec.event_tokens.append(None)
        if info.usage_completion is not None:
            rec.usage_completion_tokens = info.usage_completion


@dataclass
class Endpoint:
    """Where and how to send: the chat URL, model, and the optional fields the server took."""

    base_url: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    continuous_usage: bool = True
    include_usage: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    send_class: bool = False  # the workload class name as the request's "class" field
    class_priority: dict[str, int] = field(default_factory=dict)  # "priority" per class
    capabilities: dict[str, Any] = field(default_factory=dict)  # what the probe learnt

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, prompt: str, max_tokens: int, class_name: str = "") -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
        }
        if self.include_usage:
            opts: dict[str, Any] = {"include_usage": True}
            if self.continuous_usage:
                opts["continuous_usage_stats"] = True
            body["stream_options"] = opts
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.send_class and class_name:
            body["class"] = class_name
        if class_name in self.class_priority:
            body["priority"] = self.class_priority[class_name]
        body.update(self.extra_body)
        return body


def make_session() -> aiohttp.ClientSession:
    """No pool cap (aiohttp's default of 100 would queue requests inside the client) and a
    1 MiB read buffer (64 KiB throttles long streams); per-request timeouts are ours."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    return aiohttp.ClientSession(
        connector=connector,
        read_bufsize=1 << 20,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
    )


async def _stream(
    session: aiohttp.ClientSession, ep: Endpoint, body: dict[str, Any], rec: RequestRecord
) -> None:
    rec.start = now()
    async with session.post(ep.chat_url, json=body, headers=ep.headers()) as resp:
        rec.header = now()
        if resp.status != 200:
            text = (await resp.text())[:300]
            rec.ok, rec.error = False, f"http_{resp.status}"
            log.debug("request %d: HTTP %d %s", rec.index, resp.status, text)
            return
        timer = StreamTimer(rec)
        async for line in resp.content:
            timer.feed(line, now())
        if rec.ok and not rec.events:
            rec.ok, rec.error = False, "no_tokens"


async def send_one(
    session: aiohttp.ClientSession,
    ep: Endpoint,
    prompt: str,
    rec: RequestRecord,
    timeout_s: float | None,
) -> RequestRecord:
    """Send one streaming request, filling ``rec`` in place (partial on timeout/error)."""
    body = ep.payload(prompt, rec.max_tokens or 16, rec.class_name)
    try:
        await asyncio.wait_for(_stream(session, ep, body, rec), timeout_s)
    except asyncio.TimeoutError:
        rec.ok, rec.error, rec.timed_out = False, "timeout", True
    except (aiohttp.ClientError, json.JSONDecodeError, OSError) as exc:
        rec.ok, rec.error = False, type(exc).__name__
    except Exception as exc:  # one malformed response must not end the whole run
        log.warning("request %d failed unexpectedly: %r", rec.index, exc)
        rec.ok, rec.error = False, type(exc).__name__
    rec.end = now()
    return rec


async def probe(
    session: aiohttp.ClientSession, ep: Endpoint, timeout_s: float = 120.0
) -> dict[str, Any]:
    """One small request per option set, dropping optional fields the server rejects (400/422)
    in turn; updates ``ep`` and returns what was learnt (recorded in the experiment)."""
    attempts = [
        {},
        {"continuous_usage": False},
        {"continuous_usage": False, "ignore_eos": False},
        {"continuous_usage": False, "ignore_eos": False, "include_usage": False},
    ]
    last: RequestRecord | None = None
    for change in attempts:
        for k, v in change.items():
            setattr(ep, k, v)
        rec = RequestRecord(-1, "probe", now(), max_tokens=8)
        await send_one(session, ep, "Say hello.", rec, timeout_s)
        last = rec
        if rec.ok or rec.error not in ("http_400", "http_422"):
            break
    assert last is not None
    caps = {
        "ok": last.ok,
        "error": last.error,
        "ignore_eos": ep.ignore_eos,
        "include_usage": ep.include_usage,
        "continuous_usage_stats": ep.continuous_usage,
        "usage_in_stream": last.usage_completion_tokens is not None,
        "per_event_usage": bool(last.event_tokens) and None not in last.event_tokens,
        "probe_tokens": last.usage_completion_tokens,
        "probe_events": len(last.events),
    }
    if ep.continuous_usage and not caps["per_event_usage"]:
        ep.continuous_usage = False  # accepted but ignored: do not pretend
        caps["continuous_usage_stats"] = False
    return caps


async def discover_model(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> str | None:
    try:
        async with session.get(base_url.rstrip("/") + "/models", headers=headers) as resp:
            if resp.status == 200:
                data = (await resp.json()).get("data") or []
                return str(data[0]["id"]) if data else None
    except (aiohttp.ClientError, OSError, ValueError, KeyError):
        return None
    return None


async def discover_version(session: aiohttp.ClientSession, root_url: str) -> str | None:
    """The server's ``/version`` (vLLM, poise), when it has one."""
    try:
        async with session.get(root_url.rstrip("/") + "/version") as resp:
            if resp.status == 200:
                version = (await resp.json(content_type=None)).get("version")
                return str(version) if version is not None else None
    except (aiohttp.ClientError, OSError, ValueError, AttributeError):
        return None
    return None


class Scraper:
    """Scrapes ``/metrics`` every ``interval`` seconds in the background; parsing runs in a
    thread so a large exposition does not stall the event loop (and the timings)."""

    def __init__(self, url: str, interval: float = 1.0, engine: str | None = None) -> None:
        self.url = url
        self.interval = interval
        self.engine = engine.lower() if engine else None
        self.scrapes: list[Scrape] = []
        self.errors = 0
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def scrape_once(self) -> Scrape | None:
        assert self._session is not None
        try:
            async with self._session.get(self.url) as resp:
                if resp.status != 200:
                    self.errors += 1
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            self.errors += 1
            return None
        t = now()
        if self.engine not in ADAPTERS:
            # Not told, or told a free-form name ("vLLM 0.11"): detect from the series names.
            values, _ = await asyncio.to_thread(parse_samples, text)
            self.engine = detect_engine(list(values)) or "unknown"
        adapter = ADAPTERS.get(self.engine)
        if adapter is None:
            return None
        scrape = await asyncio.to_thread(map_scrape, t, text, adapter)
        self.scrapes.append(scrape)
        return scrape

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.scrape_once()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self.scrapes = []
        await self.scrape_once()  # the opening scrape: counters before the window
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.scrape_once()  # the closing scrape: counters after the window
        if self._session is not None:
            await self._session.close()


class LoopLagMonitor:
    """Measures how late the event loop wakes a ``period`` sleep: the client's own lag."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t = now()
            await asyncio.sleep(self.period)
            self.lags.append(max(0.0, now() - t - self.period))

    def start(self) -> None:
        self.lags = []
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> list[float]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.lags


Clock = Callable[[], float]
