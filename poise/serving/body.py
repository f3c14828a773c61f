"""Reading a request body: a size limit before anything is read, then strict JSON.

``BodySizeLimit`` (ASGI middleware) answers 413 before the app runs when Content-Length is over
``--max-request-body-bytes``, and counts the bytes of a body without one (chunked) as they
arrive, failing the read as soon as the count passes the limit: an over-long body is never
held in memory, parsed or tokenized. (FastAPI's own ``max_body_size`` exists only in recent
versions and answers in its own shape; this one answers in OpenAI's for every route.)

``OpenAIRoute`` parses JSON bodies strictly, turning what ``json.loads`` accepts but a client
cannot have meant into 400s that say what is wrong: bytes that are not UTF-8, nesting deeper
than the parser's recursion limit, integers of more than 4,300 digits (Python's limit), and
lone UTF-16 surrogates (``"\\ud800"``: valid JSON, not valid Unicode, and the tokenizer and the
response encoder both fail on them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poise.errors import InvalidRequestError
from poise.serving.protocol import ErrorInfo, ErrorResponse

_FLAG = "--max-request-body-bytes"
# A JSON escape of a UTF-16 surrogate: only these can decode to a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class BodyTooLarge(StarletteHTTPException):
    """413; an HTTPException so that FastAPI's body reader re-raises it unchanged."""

    def __init__(self, limit: int, length: int | None = None) -> None:
        size = f"{length} bytes" if length is not None else f"more than {limit} bytes"
        super().__init__(
            413, f"request body is {size}; this server accepts at most {limit} ({_FLAG})"
        )


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await _send_413(send, BodyTooLarge(self.max_bytes, length))
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as exc:  # read outside a route (the routes answer it themselves)
            if started:
                raise
            await _send_413(send, exc)


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


async def _send_413(send: Send, exc: BodyTooLarge) -> None:
    body = ErrorResponse(
        error=ErrorInfo(message=str(exc.detail), type="invalid_request_error", code=413)
    ).model_dump_json()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            # The rest of the body is never read, so this connection cannot carry another.
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body.encode()})


# ---- strict JSON ------------------------------------------------------------------------------


def parse_json_body(body: bytes) -> Any:
    """``json.loads`` that raises InvalidRequestError (naming the field where it can) for
    input a client cannot have meant; a syntax error stays ``json.JSONDecodeError``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"the request body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset "
            f"{exc.start})"
        ) from None
    try:
        value = json.loads(text, parse_float=_json_number)
    except RecursionError:
        raise InvalidRequestError("the JSON body is nested too deeply") from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # int() refusing more than sys.get_int_max_str_digits() digits
        raise InvalidRequestError(f"a number in the JSON body is too long: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):
        where = _lone_surrogate_path(value)
        if where is not None:
            raise InvalidRequestError(
                f"{where[0]} contains a lone UTF-16 surrogate (U+{where[1]:04X}); text must be "
                "valid Unicode",
                where[0].split("[", 1)[0].split(".", 1)[0] or None,
            )
    return value


def _json_number(text: str) -> float | int:
    """A JSON number written with a fraction or exponent. JSON (and JSON Schema) has one number
    type: ``5.0`` is the integer 5, and the strict request models take it where an integer is
    due; a float field takes an int as the same value."""
    value = float(text)
    return int(value) if value.is_integer() else value


def _lone_surrogate_path(value: Any) -> tuple[str, int] | None:
    """(path, code point) of the first string (or key) holding a lone surrogate, or None.

    Iterative, so any depth that ``json.loads`` accepted is walked without recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            bad = _first_surrogate(item)
            if bad is not None:
                return path or "body", bad
        elif isinstance(item, dict):
            for key, child in item.items():
                bad = _first_surrogate(key)
                if bad is not None:
                    return (f"{path}.{key!r}" if path else "body"), bad
                stack.append((f"{path}.{key}" if path else key, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return None


def _first_surrogate(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return ord(text[exc.start])
    return None


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class OpenAIRoute(APIRoute):
    """A route whose JSON body goes through ``parse_json_body``.

    FastAPI wraps what ``Request.json`` raises (other than a syntax error) in an HTTPException
    400 whose ``__cause__`` is our InvalidRequestError; http_errors.py answers with its message."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict
