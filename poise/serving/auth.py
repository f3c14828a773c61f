"""``--api-key``: Bearer authentication for the API routes, answered 401 in OpenAI's shape.

Open without a key: the probes and the scrape endpoint (``/health``, ``/ready``, ``/metrics``,
``/version``), so that load balancers and Prometheus keep working, as in vLLM. Every other
path needs ``Authorization: Bearer <key>``. The comparison is ``hmac.compare_digest`` on
bytes, so the time it takes does not reveal how much of a guessed key was right.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from poise.serving.app import error_response

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})
# The environment variables read when --api-key is not given (ours first, then vLLM's).
API_KEY_ENV = ("POISE_API_KEY", "VLLM_API_KEY")


def api_key_from_env() -> str | None:
    return next((os.environ[v] for v in API_KEY_ENV if os.environ.get(v)), None)


class ApiKeyMiddleware:
    """ASGI middleware: 401 for a request to a protected path without the right Bearer key."""

    def __init__(self, app: Any, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key: must not be empty")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self._expected):
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
