"""Errors that cross module boundaries, each mapped to one HTTP status by the server."""

from __future__ import annotations


class PoiseError(Exception):
    """Base class."""


class InvalidRequestError(PoiseError, ValueError):
    """The request can never be served as asked (HTTP 400). ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class OverloadedError(PoiseError):
    """The engine cannot take this request now (HTTP 429 with Retry-After).

    ``retry_after_s`` is the engine's prediction of when it could (no constant guess);
    ``reason`` names the limit for the rejection counter: ``queue_full``, ``slo`` (predicted to
    miss its TTFT target), ``shutting_down``.
    """

    def __init__(self, message: str, retry_after_s: float, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.reason = reason


class EngineDeadError(PoiseError):
    """The engine loop failed; requests cannot be served (HTTP 500 / 503)."""


class ShuttingDownError(PoiseError):
    """The server is shutting down and stopped this request (HTTP 503; in a stream, an error
    event then ``[DONE]``)."""
