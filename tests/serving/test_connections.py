"""Slow and surplus clients, and exposure: read deadlines, the connection cap, the Host check
and the docs routes, against the app as `poise serve` configures it (fake executor, real
tokenizer; raw sockets where a client misbehaves)."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from poise.config import EngineConfig
from poise.engine.core import EngineCore
from poise.serving.hosts import allowed_host_names, host_name
from poise.serving.server import build_state
from poise.serving.settings import ServerSettings
from tests.serving.conftest import InProcessServer
from tests.unit.fake_executor import FakeExecutor


def _server(tokenizer: Any, **settings: Any) -> InProcessServer:
    vocab = len(tokenizer)
    cfg = EngineConfig.from_kwargs(block_size=16)
    core = EngineCore(
        cfg, FakeExecutor(vocab, 16), num_kv_blocks=64, max_model_len=512, vocab_size=vocab
    )
    state = build_state(core, tokenizer, model_name="fake", vocab_size=vocab)
    return InProcessServer(state, ServerSettings(**settings))


@pytest.fixture(scope="module")
def slow_server(smol_tokenizer: Any) -> Iterator[InProcessServer]:
    with _server(smol_tokenizer, header_read_timeout_s=0.6, body_read_timeout_s=0.6) as server:
        yield server


def _connect(server: InProcessServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _read_until_closed(sock: socket.socket) -> bytes:
    """What the server sent before closing. A close with client bytes still unread becomes a
    reset, reported after the data that came before it (a trickling client races it)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _timed_out_with_408(sock: socket.socket, phase: str) -> float:
    """Seconds until the server answered 408 and closed the connection."""
    start = time.monotonic()
    data = _read_until_closed(sock)
    elapsed = time.monotonic() - start
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and phase in error["message"]
    return elapsed


def test_a_half_sent_request_head_is_closed_after_the_header_timeout(
    slow_server: InProcessServer,
) -> None:
    sock = _connect(slow_server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    assert _timed_out_with_408(sock, "headers") < 5
    assert httpx.get(slow_server.base_url + "/health").status_code == 200


def test_trickling_a_request_head_does_not_extend_the_deadline(
    slow_server: InProcessServer,
) -> None:
    sock = _connect(slow_server)
    start = time.monotonic()
    for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break  # the server answered and closed since the last look
        if select.select([sock], [], [], 0.1)[0]:
            break  # the server answered
    _timed_out_with_408(sock, "headers")
    assert time.monotonic() - start < 5  # all of it, at 10 bytes/s, would take 15 s


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(
    slow_server: InProcessServer,
) -> None:
    assert _timed_out_with_408(_connect(slow_server), "headers") < 5


def test_a_half_sent_body_is_closed_after_the_body_timeout(
    slow_server: InProcessServer,
) -> None:
    sock = _connect(slow_server)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
    )
    assert _timed_out_with_408(sock, "body") < 5
    assert httpx.get(slow_server.base_url + "/health").status_code == 200


def test_a_kept_alive_connection_gets_a_fresh_header_deadline(
    slow_server: InProcessServer,
) -> None:
    """A served request, then half of the next one on the same connection: closed too."""
    sock = _connect(slow_server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = b""
    while not first.endswith(b"}"):  # the whole JSON answer
        first += sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200"), first
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    assert _timed_out_with_408(sock, "headers") < 5


@pytest.mark.parametrize(
    "raw",
    [b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20000],
    ids=["garbage", "head-over-16KiB"],
)
def test_bytes_that_are_not_http_get_a_json_400(slow_server: InProcessServer, raw: bytes) -> None:
    sock = _connect(slow_server)
    sock.sendall(raw)
    head, _, body = _read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert "invalid HTTP request" in json.loads(body)["error"]["message"]


def test_connections_beyond_the_cap_get_503(smol_tokenizer: Any) -> None:
    with _server(smol_tokenizer, max_connections=2) as server:
        held = [_connect(server), _connect(server)]
        time.sleep(0.3)  # let the server accept both
        over = httpx.get(server.base_url + "/health")
        assert over.status_code == 503, over.text
        assert over.json()["error"]["code"] == "too_many_connections"
        assert over.headers["Retry-After"] == "1" and over.headers["Connection"] == "close"
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while httpx.get(server.base_url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the cap did not free up"
            time.sleep(0.05)


def test_a_foreign_host_header_is_refused_when_bound_to_loopback(smol_tokenizer: Any) -> None:
    with _server(smol_tokenizer, allowed_hosts=["poise.internal"]) as server:
        url = server.base_url + "/v1/models"
        for host in ("127.0.0.1", "localhost", "[::1]", "LOCALHOST.", "poise.internal"):
            r = httpx.get(url, headers={"Host": f"{host}:{server.port}"})
            assert r.status_code == 200, (host, r.text)
        for host in ("evil.example", "127.0.0.1.evil.example", "localhost.evil.example"):
            r = httpx.get(url, headers={"Host": f"{host}:{server.port}"})
            assert r.status_code == 421, (host, r.text)
            error = r.json()["error"]
            assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"]


def test_allowed_host_names() -> None:
    assert allowed_host_names("0.0.0.0", []) is None  # bound beyond loopback: no check
    assert allowed_host_names("127.0.0.1", ["*"]) is None
    assert allowed_host_names("0.0.0.0", ["api.example"]) == {"api.example"}
    loop = allowed_host_names("127.0.0.2", [])
    assert loop == {"localhost", "127.0.0.1", "::1", "127.0.0.2"}
    assert allowed_host_names("::1", ["fe80::1", "[fe80::2]", "Api.Example:8000"]) == {
        "localhost",
        "127.0.0.1",
        "::1",
        "fe80::1",
        "fe80::2",
        "api.example",
    }
    assert host_name("[::1]:8000") == "::1" and host_name("Example.COM.:80") == "example.com"


def test_api_docs_are_off_unless_enabled(smol_tokenizer: Any) -> None:
    paths = ("/docs", "/redoc", "/openapi.json")
    with _server(smol_tokenizer) as server:
        for path in paths:
            r = httpx.get(server.base_url + path)
            assert r.status_code == 404, (path, r.status_code)
    with _server(smol_tokenizer, enable_api_docs=True) as server:
        for path in paths:
            assert httpx.get(server.base_url + path).status_code == 200, path
