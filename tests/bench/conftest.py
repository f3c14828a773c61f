"""Fixtures for bench tests: a scripted mock SSE server per test (see mock_server.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from mock_server import MockServer, Script  # noqa: E402


@pytest.fixture
def mock() -> Iterator[Callable[..., MockServer]]:
    servers: list[MockServer] = []

    def start(**kw: object) -> MockServer:
        srv = MockServer(Script(**kw)).start()  # type: ignore[arg-type]
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()
