"""Errors that cross module boundaries, each mapped to one HTTP status by the server."""

from __future__ import annotations


class PoiseError(Exception):
    """Base class."""


class InvalidRequestError(PoiseError, ValueError):
    """The request can never be served as asked (HTTP 400). ``param`` names the field;
    ``reason`` labels the rejection counter: ``invalid``, or ``too_long`` (the prompt exceeds
    max_model_len, the KV pool, or a token budget it must fit whole)."""

    def __init__(self, message: str, param: str | None = None, reason: str = "invalid") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.reason = reason


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


class StepFailedError(PoiseError):
    """An engine step raised after it was scheduled (in the executor, or applying its result).

    ``request_ids``: the requests that step scheduled, so the caller can fail exactly those
    (``EngineCore.fail``). Until then they keep their blocks and progress: nothing of the step
    was applied (unless applying its result raised part-way). ``__cause__`` is the original.
    """

    def __init__(self, step_id: int, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step {step_id} failed: {type(cause).__name__}: {cause}")
        self.step_id = step_id
        self.request_ids = request_ids
