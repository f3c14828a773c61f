"""DNS-rebinding defence: a server bound to loopback answers only requests addressed to it.

A web page can point a name it controls at 127.0.0.1 and then drive a local server from the
victim's browser (same origin as far as the browser is concerned). The request still carries
the attacker's name in its Host header, so a loopback-bound server refuses any Host that is
not a loopback name, the bound host, or one the operator allowed (``--allowed-hosts``).

Requests without a Host header (HTTP/1.0) pass: browsers always send one.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from poise.serving.http_errors import error_response

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """'Example.COM:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.partition(":")[0].rstrip(".")


def configured_name(name: str) -> str:
    """A name from --host or --allowed-hosts: also a bare IPv6 literal ('::1'), which a Host
    header would bracket."""
    name = name.strip().lower()
    if name.count(":") > 1 and not name.startswith("["):
        return name
    return host_name(name)


def allowed_host_names(bind_host: str, extra: list[str]) -> frozenset[str] | None:
    """The Host names to accept, or None for no check (bound beyond loopback and no
    ``--allowed-hosts``, or ``*`` among them)."""
    if "*" in extra or (not is_loopback(bind_host) and not extra):
        return None
    names = {configured_name(h) for h in extra}
    if is_loopback(bind_host):
        names |= {*LOOPBACK_NAMES, configured_name(bind_host)}
    return frozenset(names)


class AllowedHostsMiddleware:
    """ASGI middleware: 421 in OpenAI's error shape for a Host outside ``allowed``."""

    def __init__(self, app: Any, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = next((v for k, v in scope["headers"] if k == b"host"), None)
            if host is not None and host_name(host.decode("latin-1")) not in self.allowed:
                await _refuse(scope, receive, send, host.decode("latin-1"))
                return
        await self.app(scope, receive, send)


async def _refuse(scope: Any, receive: Any, send: Any, host: str) -> None:
    message = (
        f"Host {host[:100]!r} is not served here; start the server with --allowed-hosts "
        "to accept it"
    )
    await error_response(421, message, code="host_not_allowed")(scope, receive, send)
