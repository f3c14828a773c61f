"""Every error the HTTP server answers, in OpenAI's shape.

``{"error": {"message", "type", "param", "code"}}`` whatever failed: our own errors
(``map_exception``), pydantic validation (400, never FastAPI's 422), Starlette's HTTP errors
(unknown route 404, wrong method 405, a body FastAPI could not parse 400) and anything
unexpected (500). No answer carries FastAPI's ``{"detail": ...}`` or a plain-text body.

Mapping: InvalidRequestError and validation -> 400 (``param`` names the field), unknown model
-> 400, OverloadedError -> 429 + Retry-After, EngineDeadError and ShuttingDownError -> 503,
GenerationFailed -> 500.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from poise.errors import (
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
    PoiseError,
    ShuttingDownError,
)
from poise.serving.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class GenerationFailed(PoiseError):
    """The engine failed this request after admission (HTTP 500)."""


def error_response(
    status: int,
    message: str,
    *,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: int | str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=message, type=err_type, param=param, code=code or status)
    )
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _is_union_tag(part: Any) -> bool:
    # pydantic names the member of a union that failed: "str", "list[constrained-int]", ...
    return isinstance(part, str) and ("[" in part or "-" in part or part in _SCALARS)


_SCALARS = frozenset({"str", "int", "float", "bool"})


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON: {first.get('msg')}", param=None)
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if not loc and first.get("type") == "model_attributes_type":
        return error_response(400, "the request body must be a JSON object", param=None)
    param = loc[0] if loc else None
    # A value that fits no member of a union fails once per member; the member of the right
    # JSON type explains best ("List should have at least 1 item", not "not a valid string").
    same = [e for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == loc[:1]]
    telling = [e for e in same if not str(e.get("type", "")).endswith(("_type", "_parsing"))]
    chosen = telling[0] if telling else first
    where = ".".join(str(x) for x in chosen.get("loc", ()) if x != "body" and not _is_union_tag(x))
    return error_response(400, f"{where or 'body'}: {chosen.get('msg', 'invalid')}", param=param)


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    cause = exc.__cause__
    if isinstance(cause, InvalidRequestError):  # raised while parsing the body (body.py)
        return error_response(400, cause.message, param=cause.param)
    if isinstance(cause, StarletteHTTPException):  # body.BodyTooLarge, wrapped by FastAPI
        exc = cause
    status = exc.status_code
    if status == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif status == 405:
        allowed = (exc.headers or {}).get("allow") or (exc.headers or {}).get("Allow") or "?"
        message = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
    else:
        message = str(exc.detail)
    err_type = "invalid_request_error" if 400 <= status < 500 else "internal_error"
    headers = dict(exc.headers) if exc.headers else None
    return error_response(status, message, err_type=err_type, headers=headers)


def map_exception(exc: Exception, metrics: Any) -> JSONResponse:
    """The HTTP answer for an exception raised before a response started."""
    if isinstance(exc, InvalidRequestError):
        metrics.rejected(exc.reason)
        return error_response(400, exc.message, param=exc.param)
    if isinstance(exc, OverloadedError):
        metrics.rejected(exc.reason)
        # The header counts whole seconds: the engine's predicted wait, rounded up.
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return error_response(
            429,
            exc.message,
            err_type="rate_limit_error",
            code=exc.reason,
            headers={"Retry-After": retry},
        )
    if isinstance(exc, EngineDeadError):
        metrics.rejected("engine_dead")
        return error_response(503, str(exc), err_type="engine_dead", code=503)
    if isinstance(exc, ShuttingDownError):
        return error_response(
            503, str(exc), err_type="service_unavailable", code="server_shutting_down"
        )
    if isinstance(exc, GenerationFailed):
        return error_response(500, str(exc), err_type="internal_error", code=500)
    raise exc


def install_error_handlers(app: FastAPI, metrics: Any) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected("invalid")
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if 400 <= exc.status_code < 500 and exc.status_code not in (404, 405):
            metrics.rejected("invalid")
        return _http_error(request, exc)

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this answer; the client gets JSON, not text.
        return error_response(
            500, f"internal error: {type(exc).__name__}", err_type="internal_error"
        )
