"""One engine replica: poise's OpenAI server app and its engine, without a socket.

Wrapped as a Ray Serve deployment by ``deploy/app.py``; plain Python here so that it can be
read (and driven) without Ray. Ray Serve restarts a replica that dies; the ingress takes it
out of its rotation meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from poise.config import EngineConfig
from poise.deploy import asgi_bridge
from poise.serving.settings import ServerSettings


class EngineReplica:
    def __init__(self, config: EngineConfig, name: str, served_model_names: list[str]) -> None:
        self.config, self.name = config, name
        self.settings = ServerSettings(served_model_names=served_model_names)
        self._app: Any = None
        self._lock = asyncio.Lock()
        self._lifespan: tuple[Any, asyncio.Event] | None = None

    async def _started(self) -> Any:
        # The engine thread needs a running event loop, which Ray Serve's constructor lacks.
        async with self._lock:
            if self._app is None:
                from poise.serving.app import create_app
                from poise.serving.server import build_state_from_config

                state = build_state_from_config(self.config, self.settings)
                self._state = state
                app = create_app(state)
                self._lifespan = await asgi_bridge.lifespan_startup(app)
                self._app = app
        return self._app

    async def handle(self, method: str, path: str, body: bytes) -> AsyncIterator[Any]:
        """The response to one HTTP request: its start ({status, headers}), then body chunks."""
        app = await self._started()
        async for item in asgi_bridge.call(app, method, path, body):
            yield item

    async def check_health(self) -> None:
        """Ray Serve's health check and the ingress's probe: raises when the engine is dead."""
        await self._started()
        error = self._state.engine.error
        if error:
            raise RuntimeError(f"{self.name}: {error}")

    async def metrics(self) -> str:
        app = await self._started()
        chunks = [c async for c in asgi_bridge.call(app, "GET", "/metrics") if isinstance(c, bytes)]
        return b"".join(chunks).decode()

    async def pid(self) -> int:
        import os

        return os.getpid()
