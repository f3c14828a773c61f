"""``--api-key`` and ``--metrics-access``: who may call which route.

``--api-key``: Bearer authentication, answered 401 in OpenAI's shape. Open without a key: the
probes and the scrape endpoint (``/health``, ``/ready``, ``/metrics``, ``/version``), so that
load balancers and Prometheus keep working, as in vLLM. Every other path needs
``Authorization: Bearer <key>``. Both sides are hashed (SHA-256) and compared with
``hmac.compare_digest``, so the time taken reveals neither how much of a guessed key was
right nor the key's length.

``--metrics-access`` (the operator's view: ``/metrics``, the live page ``/dashboard`` and its
feed, ``/server_info``): ``open`` (the default: ``/metrics`` open, the rest behind the key when
there is one), ``key`` (all of them behind the key) or ``localhost`` (answered only to
clients on a loopback address, 403 to others, with no key needed from loopback, so a browser
on the machine can open the page).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from poise.serving.hosts import is_loopback
from poise.serving.http_errors import error_response

PROBES = frozenset({"/health", "/ready", "/version"})
OPERATOR_PATHS = frozenset({"/metrics", "/dashboard", "/dashboard/feed", "/server_info"})
METRICS_ACCESS = ("open", "key", "localhost")
# The environment variables read when --api-key is not given (ours first, then vLLM's).
API_KEY_ENV = ("POISE_API_KEY", "VLLM_API_KEY")


def api_key_from_env() -> str | None:
    return next((os.environ[v] for v in API_KEY_ENV if os.environ.get(v)), None)


def open_paths(metrics_access: str) -> frozenset[str]:
    """The paths served without the key."""
    if metrics_access == "open":
        return PROBES | {"/metrics"}
    if metrics_access == "localhost":  # LoopbackOnly guards them instead
        return PROBES | OPERATOR_PATHS
    return PROBES


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiKeyMiddleware:
    """ASGI middleware: 401 for a request to a protected path without the right Bearer key."""

    def __init__(self, app: Any, api_key: str, open_paths: frozenset[str] = PROBES) -> None:
        if not api_key:
            raise ValueError("api_key: must not be empty")
        self.app = app
        self.open_paths = open_paths
        self._expected = _digest(f"Bearer {api_key}".encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(_digest(given), self._expected):
                message = (
                    "Incorrect API key provided; send it as 'Authorization: Bearer <key>'"
                    if given
                    else "Missing API key; send it as 'Authorization: Bearer <key>'"
                )
                response = error_response(401, message, code="invalid_api_key")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LoopbackOnlyMiddleware:
    """ASGI middleware: 403 for a request to ``paths`` from a peer not on a loopback address."""

    def __init__(self, app: Any, paths: frozenset[str] = OPERATOR_PATHS) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths:
            client = scope.get("client")
            if client is None or not is_loopback(str(client[0])):
                response = error_response(
                    403,
                    f"{scope['path']} is served to localhost only (--metrics-access localhost)",
                    err_type="permission_error",
                    code="localhost_only",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
