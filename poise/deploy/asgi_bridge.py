"""Run one HTTP request through an ASGI app in-process, yielding what it sends.

A replica serves poise's own FastAPI app (validation, chat template, errors, SSE) without a
socket: the ingress forwards method, path and body; the first item back is the response start
({"status", "headers"}), then the body chunks as the app sends them, so streaming passes through
unchanged. Closing the generator early (the client left) tells the app ``http.disconnect``,
which aborts the request in its engine like a dropped connection would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any


async def call(
    app: Any,
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[tuple[str, str]] | None = None,
) -> AsyncIterator[dict[str, Any] | bytes]:
    out: asyncio.Queue[dict[str, Any] | bytes | None] = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            hdrs = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
            await out.put({"status": message["status"], "headers": hdrs})
        elif message["type"] == "http.response.body":
            if message.get("body"):
                await out.put(bytes(message["body"]))
            if not message.get("more_body", False):
                await out.put(None)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 0),
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            *((k.lower().encode(), v.encode()) for k, v in headers or []),
        ],
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.create_task(run())
    try:
        while (item := await out.get()) is not None:
            yield item
    finally:
        gone.set()
        if not task.done():
            # Give the app a moment to see the disconnect and abort cleanly, then cut it.
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            task.cancel()


async def lifespan_startup(app: Any) -> tuple[asyncio.Task[None], asyncio.Event]:
    """Run the app's lifespan startup; returns (the lifespan task, the event that ends it)."""
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "lifespan.startup"}
        await stop.wait()
        return {"type": "lifespan.shutdown"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.complete" and not started.done():
            started.set_result(None)
        elif message["type"] == "lifespan.startup.failed" and not started.done():
            started.set_exception(RuntimeError(message.get("message", "startup failed")))

    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
    await started
    return task, stop
