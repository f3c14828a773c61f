"""Slow and surplus clients: read deadlines and a connection cap at the HTTP protocol level.

uvicorn times out only idle kept-alive connections (``timeout_keep_alive``, and that timer
stops at a request's first byte); a client that sends half a request line, or headers and
then a trickle of body, holds its connection and file handle forever (uvicorn issue #157 asks
for exactly these timeouts). ASGI middleware cannot help: the app is called only once the
headers are parsed. So this subclasses uvicorn's h11 protocol:

- headers: a connection must deliver a whole request head within ``header_read_timeout_s`` of
  being accepted (or of the first byte of the next request on a kept-alive connection);
- body: the body must be complete within ``body_read_timeout_s`` of the head;
- either deadline answers 408 (OpenAI's error JSON) if no response has started, and closes;
- a connection accepted while ``max_connections`` are already open is answered 503 (same
  shape, ``Connection: close``) as soon as its request head arrives; its header deadline
  still applies if it never sends one;
- bytes that are not HTTP get uvicorn's 400, in OpenAI's shape rather than plain text.

Deadlines are absolute per phase (not reset by each byte), so trickling does not extend them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from poise.serving.http_errors import error_response


@dataclass(frozen=True)
class ConnectionLimits:
    header_read_timeout_s: float
    body_read_timeout_s: float
    max_connections: int


async def _over_capacity(scope: Any, receive: Any, send: Any) -> None:
    """The ASGI app a connection beyond the cap gets instead of poise's."""
    response = error_response(
        503,
        "too many open connections; retry later",
        err_type="service_unavailable",
        code="too_many_connections",
        headers={"Connection": "close", "Retry-After": "1"},
    )
    await response(scope, receive, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and a connection cap (``limits``)."""

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None  # "headers" or "body" while a deadline runs
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.app = _over_capacity
        self._enter("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP (a malformed request line, a head over
        h11's 16 KiB): the same 400, in OpenAI's error shape instead of plain text."""
        body = bytes(error_response(400, f"invalid HTTP request: {msg}", code=400).body)
        self._write_and_close(400, body)

    def _write_and_close(self, status: int, body: bytes) -> None:
        """Answer outside the h11 state machine (the request was never parsed) and close."""
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()

    def _follow(self) -> None:
        """Put the deadline in the phase h11 says the client's side of the request is in."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._enter("body")
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            self._enter("headers")  # part of a next request head is buffered
        elif state is h11.IDLE and self._phase == "headers":
            pass  # nothing of a request yet on a new connection: its deadline keeps running
        else:
            self._enter(None)  # request read whole, or idle between requests (keep-alive timer)

    def _enter(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None and not self.transport.is_closing():
            timeout = (
                self.limits.header_read_timeout_s
                if phase == "headers"
                else self.limits.body_read_timeout_s
            )
            self._deadline = self.loop.call_later(timeout, self._expire, phase, timeout)

    def _expire(self, phase: str, timeout: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if phase == "headers" or self.cycle is None or not self.cycle.response_started:
            message = f"request {phase} not received within {timeout:g} s"
            body = bytes(error_response(408, message, code="request_timeout").body)
            self._write_and_close(408, body)
        else:  # a response is under way: only closing is left
            self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol bound to ``limits``, for ``uvicorn.Config(http=...)``."""
    return type("PoiseH11Protocol", (GuardedH11Protocol,), {"limits": limits})
