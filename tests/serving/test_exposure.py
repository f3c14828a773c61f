"""Access control and exposure (issue 16, item 5): the API key on every route but the probes,
``--metrics-access`` for the operator's view, CORS off unless ``--allowed-origins``, no prompt
in the logs, and no file path taken from a request.

The real app around the fake executor and the SmolLM2 tokenizer, in this process; a request
from a non-loopback address is an ASGI call with that client address (a test cannot open a
socket from another machine).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from poise.config import EngineConfig
from poise.engine.core import EngineCore
from poise.serving.server import asgi_app, build_state
from poise.serving.settings import ServerSettings
from poise.text import eos_token_ids
from tests.serving.conftest import InProcessServer
from tests.unit.fake_executor import FakeExecutor

KEY = "k3y-for-tests"
SECRET = "the-secret-prompt-2718"


def _state(tokenizer: Any) -> Any:
    vocab = len(tokenizer)
    core = EngineCore(
        EngineConfig.from_kwargs(block_size=16),
        FakeExecutor(vocab, 16),
        num_kv_blocks=128,
        max_model_len=512,
        vocab_size=vocab,
        eos_token_ids=eos_token_ids(tokenizer),
    )
    settings = ServerSettings(enable_log_requests=True)
    return build_state(core, tokenizer, model_name="fake", vocab_size=vocab, settings=settings)


def _get(app: Any, path: str, client: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """GET ``path`` from ``app`` as if from ``client`` (an address), without a socket."""
    transport = httpx.ASGITransport(app=app, client=(client, 40000))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.get(path, headers=headers)

    return asyncio.run(go())


ROUTES = [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/server_info"),
    ("GET", "/dashboard"),
    ("GET", "/openapi.json"),
]


def test_every_route_but_the_probes_needs_the_key(smol_tokenizer: Any) -> None:
    settings = ServerSettings(api_key=KEY, enable_api_docs=True)
    with InProcessServer(_state(smol_tokenizer), settings) as server:
        for method, path in ROUTES:
            for auth in (None, "Bearer wrong", f"Bearer {KEY}x", KEY):
                headers = {"Authorization": auth} if auth else {}
                r = httpx.request(method, server.base_url + path, headers=headers, json={})
                assert r.status_code == 401, (method, path, auth, r.status_code)
                assert r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/health", "/ready", "/version", "/metrics"):
            assert httpx.get(server.base_url + path).status_code == 200, path
        ok = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200


@pytest.mark.parametrize("access", ["key", "localhost"])
def test_metrics_access_keeps_the_operator_view_private(smol_tokenizer: Any, access: str) -> None:
    settings = ServerSettings(api_key=KEY, metrics_access=access)
    app = asgi_app(_state(smol_tokenizer), settings)
    for path in ("/metrics", "/server_info", "/dashboard"):
        remote = _get(app, path, "203.0.113.7")
        assert remote.status_code == (401 if access == "key" else 403), (path, remote.text)
        local = _get(app, path, "127.0.0.1")
        assert local.status_code == (401 if access == "key" else 200), path
        keyed = _get(app, path, "127.0.0.1", {"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200, path
    # The probes stay open (503 here only because this app's engine thread is not started).
    assert _get(app, "/health", "203.0.113.7").status_code not in (401, 403)


def test_metrics_access_key_needs_a_key() -> None:
    with pytest.raises(ValueError, match="metrics_access"):
        ServerSettings(metrics_access="key")
    with pytest.raises(ValueError, match="metrics_access"):
        ServerSettings(metrics_access="everyone")


def test_cors_is_off_unless_origins_are_allowed(smol_tokenizer: Any) -> None:
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    with InProcessServer(_state(smol_tokenizer)) as server:
        r = httpx.options(server.base_url + "/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = httpx.get(server.base_url + "/v1/models", headers={"Origin": "https://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    settings = ServerSettings(allowed_origins=["https://app.example"])
    with InProcessServer(_state(smol_tokenizer), settings) as server:
        ok = {**preflight, "Origin": "https://app.example"}
        r = httpx.options(server.base_url + "/v1/completions", headers=ok)
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.options(server.base_url + "/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers


def test_no_prompt_in_the_logs_and_no_path_from_a_request(
    smol_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with InProcessServer(_state(smol_tokenizer)) as server:
        url = server.base_url
        chat = [{"role": "user", "content": SECRET}]
        assert (
            httpx.post(
                url + "/v1/chat/completions", json={"messages": chat, "max_tokens": 2}
            ).status_code
            == 200
        )
        assert (
            httpx.post(
                url + "/v1/completions", json={"prompt": SECRET, "max_tokens": -1}
            ).status_code
            == 400
        )
        assert (
            httpx.post(
                url + "/v1/completions", json={"prompt": SECRET, "max_tokens": 10_000}
            ).status_code
            == 400
        )
        # The model is a served name, never a path to load.
        r = httpx.post(url + "/v1/completions", json={"model": "/etc/passwd", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # A chat template is the operator's (--chat-template): not taken from a request, where
        # it is code the server would run (a nested loop of 10^10 steps held the tokenizer).
        loop = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
        r = httpx.post(
            url + "/tokenize", json={"messages": chat, "chat_template": loop}, timeout=10
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "request finished" in caplog.text  # the request log is on ...
    assert SECRET not in caplog.text  # ... and never says the prompt
