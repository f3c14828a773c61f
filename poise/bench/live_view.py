"""``poise bench --live``: the live page's view in the terminal while the bench runs.

A poise server streams its one-point-a-second feed at ``GET /dashboard/feed`` (the same feed the
``/dashboard`` page draws). ``FeedReader`` follows it in the bench's own event loop (one
connection; SSE parsed by hand because it is two line prefixes) and keeps the last minutes;
``render`` turns the latest points into a rich view: the cell progress, the server's state
(running, waiting, KV, prefix cache hits, budget), the step composition, TTFT split in its
parts as a stacked bar, per-class SLO attainment and sparklines of TTFT, queue and KV. Another
engine has no such feed: the view then says so and shows the progress only (its /metrics are
still scraped into the record as usual).

Cost: the feed is one small JSON event a second; the view redraws twice a second from data
already in memory, so a live view does not disturb the bench's own client-lag measurement.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Sequence
from typing import Any

import aiohttp
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from poise.bench.bench_config import server_root

HISTORY = 120  # points kept (one a second): the sparklines' width
_SPARKS = "▁▂▃▄▅▆▇█"
_PARTS = (
    ("ingress", "way in", "magenta"),
    ("queue", "queue", "yellow"),
    ("prefill_compute", "prefill", "cyan"),
    ("first_token_sched", "1st-token sched", "blue"),
)


class FeedReader:
    """Follows ``/dashboard/feed``: ``config`` (the server's self-description) and ``points``."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.url = server_root(base_url) + "/dashboard/feed"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.config: dict[str, Any] | None = None
        self.points: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.unavailable: str | None = None  # why there is no feed (another engine, an error)

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(self.url, headers=self.headers) as resp,
            ):
                if resp.status != 200:
                    self.unavailable = f"no live feed at {self.url} (HTTP {resp.status})"
                    return
                event = ""
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        self._on(event, json.loads(line[5:]))
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            self.unavailable = f"live feed lost: {exc}"

    def _on(self, event: str, data: Any) -> None:
        if event == "config":
            self.config = data
        elif event == "point":
            self.points.append(data)


def sparkline(values: Sequence[float | None], width: int = 40) -> str:
    """Unicode blocks scaled to the window's maximum (a blank where a value is missing)."""
    tail = list(values)[-width:]
    top = max((v for v in tail if v is not None), default=0.0)
    if top <= 0:
        return "".join(" " if v is None else _SPARKS[0] for v in tail)
    scale = len(_SPARKS) - 1
    return "".join(" " if v is None else _SPARKS[round(v / top * scale)] for v in tail)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ttft_bar(parts: dict[str, float], width: int = 40) -> Text:
    total = sum(parts.values())
    bar = Text()
    if total <= 0:
        return bar
    for key, _label, colour in _PARTS:
        share = parts.get(key, 0.0) / total
        n = round(share * width)
        if n:
            bar.append("█" * n, style=colour)
    bar.append("  ")
    for key, label, colour in _PARTS:
        bar.append(f"{label} {_ms(parts.get(key))}  ", style=colour)
    return bar


def _config_line(config: dict[str, Any] | None) -> str:
    if not config:
        return ""
    engine = config.get("engine_config") or {}
    keys = (
        "max_num_batched_tokens",
        "max_num_seqs",
        "scheduling_policy",
        "enable_chunked_prefill",
        "enable_prefix_caching",
    )
    knobs = ", ".join(f"{k}={engine[k]}" for k in keys if k in engine)
    head = " · ".join(str(config[k]) for k in ("model", "dtype", "device") if config.get(k))
    return f"{head}  {knobs}".strip()


def render(reader: FeedReader, progress: RenderableType | None = None) -> RenderableType:
    """The whole view from what the reader holds (pure: tested without a terminal)."""
    parts: list[RenderableType] = []
    if progress is not None:
        parts.append(progress)
    if reader.unavailable and not reader.points:
        parts.append(Text(f"server view: {reader.unavailable}", style="dim"))
        return Group(*parts)
    if not reader.points:
        parts.append(Text("server view: waiting for the first point…", style="dim"))
        return Group(*parts)
    p = reader.points[-1]
    history = list(reader.points)
    table = Table(title=_config_line(reader.config) or None, show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("running / waiting", f"{p['running']} / {p['waiting']}")
    table.add_row(
        "KV usage",
        f"{_pct(p['kv_usage'])}   prefix cache hits {_pct(p.get('prefix_cache_hit_rate'))}",
    )
    table.add_row(
        "steps",
        f"{p['steps_per_s']:.1f}/s, budget {p.get('token_budget')} tokens, "
        f"used {_pct(p['budget_utilisation'])}",
    )
    table.add_row(
        "tokens/s",
        f"prefill {p['prefill_tokens_per_s']:.0f}, decode {p['decode_tokens_per_s']:.0f}",
    )
    table.add_row(
        "requests/step",
        f"prefill {p['prefill_requests_per_step']:.2f}, decode {p['decode_requests_per_step']:.2f}",
    )
    minute = history[-60:]
    table.add_row(
        "preemptions", f"{sum(q['preemptions'] for q in minute)} in the last {len(minute)} s"
    )
    ttft = (
        f"mean {_ms(p['ttft_mean'])}, max {_ms(p['ttft_max'])} ({p['first_tokens']} first tokens)"
    )
    table.add_row("TTFT (last s)", ttft if p["first_tokens"] else "no first token this second")
    if p["first_tokens"]:
        table.add_row("TTFT parts", _ttft_bar(p["ttft_parts_mean"]))
    for cls, met in sorted((p.get("slo_ttft_attainment") or {}).items()):
        table.add_row(f"SLO {cls}", f"TTFT target met {_pct(met)}")
    firsts = [q["ttft_mean"] if q["first_tokens"] else None for q in history]
    table.add_row("TTFT mean", Text(sparkline(firsts), style="green"))
    table.add_row("waiting", Text(sparkline([q["waiting"] for q in history]), style="yellow"))
    table.add_row("KV usage", Text(sparkline([q["kv_usage"] for q in history]), style="cyan"))
    parts.append(table)
    if reader.unavailable:
        parts.append(Text(reader.unavailable, style="red"))
    return Group(*parts)


class LiveView:
    """Shows ``render`` in a rich Live display while the bench runs; ``progress`` (a rich
    Progress, not started on its own: rich allows one live display at a time) is drawn in it."""

    def __init__(
        self, console: Console, base_url: str, api_key: str | None, progress: RenderableType | None
    ) -> None:
        self.reader = FeedReader(base_url, api_key)
        self.progress = progress
        self.live = Live(
            console=console,
            refresh_per_second=2,
            get_renderable=lambda: render(self.reader, self.progress),
        )
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LiveView:
        self._task = asyncio.create_task(self.reader.run())
        self.live.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.live.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
