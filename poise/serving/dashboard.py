"""The live page: ``GET /dashboard`` (one self-contained HTML file, no CDN) and its feed,
``GET /dashboard/feed`` (server-sent events).

The feed's first event, ``config``, is the server's self-description (``/server_info``); then
one ``point`` event per second from ``poise.serving.live_page.LiveFeed`` (the history first, so a
page opened late still draws the last minutes). A feed ends when the server starts shutting
down, so an open page never holds a graceful shutdown for its grace period.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

FEED_INTERVAL_S = 1.0


def page() -> str:
    return resources.files("poise.serving").joinpath("dashboard.html").read_text("utf-8")


def _event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


async def feed(state: Any, request: Request, interval_s: float) -> AsyncIterator[str]:
    live = state.metrics.live
    yield _event("config", state.info)
    cursor = 0
    while state.engine.accepting and not await request.is_disconnected():
        live.tick(time.monotonic(), state.engine.state, min_interval_s=interval_s)
        points, cursor = live.since(cursor)
        for point in points:
            yield _event("point", point)
        await asyncio.sleep(interval_s)


def add_dashboard_routes(app: FastAPI, state: Any, interval_s: float = FEED_INTERVAL_S) -> None:
    html = page()

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(html)

    @app.get("/dashboard/feed", include_in_schema=False)
    async def dashboard_feed(request: Request) -> StreamingResponse:
        return StreamingResponse(
            feed(state, request, interval_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
