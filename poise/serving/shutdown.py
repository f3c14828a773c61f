"""Graceful shutdown that never cuts a response silently.

uvicorn's own graceful shutdown cancels the response tasks still running when
``timeout_graceful_shutdown`` runs out: a stream then stops mid-way with no finish reason, no
error and no ``[DONE]``, and a non-streaming request gets a plain-text 500, so a client cannot
tell a cut answer from a complete one. ``PoiseServer`` ends them through the engine instead:

- first SIGTERM/SIGINT: uvicorn stops accepting connections; the engine stops admitting; the
  requests in flight may finish for ``grace_s`` seconds (fractions honoured);
- when the grace period runs out, or at a second signal, every request still in flight is
  aborted in the engine (KV freed) and its reader gets ``ShuttingDownError``: a stream ends
  with an error event in OpenAI's shape and ``data: [DONE]``, a non-streaming request gets a
  JSON 503;
- uvicorn's own timeout stays as a backstop ``CUT_MARGIN_S`` later (a client that does not
  read its error event), and a third signal forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from types import FrameType

import uvicorn

from poise.serving.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

# Time the cut responses get to be written before uvicorn cancels what is left.
CUT_MARGIN_S = 5


def backstop_timeout_s(grace_s: float) -> int:
    """uvicorn's ``timeout_graceful_shutdown`` for a poise grace period (whole seconds)."""
    return math.ceil(grace_s) + CUT_MARGIN_S


class PoiseServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self._signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cut_now: asyncio.Event | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._cut_now = asyncio.Event()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 2 and self._loop is not None and self._cut_now is not None:
            logger.warning("second signal %d: cutting the requests in flight now", sig)
            self._loop.call_soon_threadsafe(self._cut_now.set)
            return
        super().handle_exit(sig, frame)
        if self._signals >= 3:
            self.force_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine.accepting = False  # /ready turns 503 at once; new requests are refused
        cutter = asyncio.ensure_future(self._cut_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            cutter.cancel()

    async def _cut_after_grace(self) -> None:
        assert self._cut_now is not None
        logger.info(
            "shutting down: %d request(s) in flight may run for up to %g s",
            self.engine.num_in_flight,
            self.grace_s,
        )
        why = f"the {self.grace_s:g} s shutdown grace period ran out"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._cut_now.wait(), self.grace_s)
            why = "a second signal asked to stop now"
        if self.engine.num_in_flight:
            logger.warning(
                "cutting %d request(s) still in flight: %s", self.engine.num_in_flight, why
            )
            self.engine.cut(f"the server is shutting down and stopped this request ({why})")
