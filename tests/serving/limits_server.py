"""The hostile-input tests' server (test_hostile_input.py, test_hostile_input_cost.py): the
real app, AsyncEngine and SmolLM2 tokenizer around the scheduler tests' deterministic fake
executor (no model), in this process, with the request limits a test asks for; and the
requests they send it and the OpenAI error shape they check its answers against."""

from __future__ import annotations

from typing import Any

import httpx

from poise.config import EngineConfig
from poise.engine.core import EngineCore
from poise.serving.server import build_state
from poise.serving.settings import RequestLimitsConfig, ServerSettings
from poise.text import eos_token_ids
from tests.serving.conftest import InProcessServer
from tests.unit.fake_executor import FakeExecutor

MAX_MODEL_LEN = 1024
USER = [{"role": "user", "content": "hello"}]


def limits_server(tokenizer: Any, **limits: Any) -> InProcessServer:
    """The server with ``RequestLimitsConfig(**limits)``; it runs inside a ``with`` block."""
    vocab = len(tokenizer)
    cfg = EngineConfig.from_kwargs(block_size=16)
    core = EngineCore(
        cfg,
        FakeExecutor(vocab, 16),
        num_kv_blocks=256,
        max_model_len=MAX_MODEL_LEN,
        vocab_size=vocab,
        eos_token_ids=eos_token_ids(tokenizer),
    )
    settings = ServerSettings(enable_api_docs=True, limits=RequestLimitsConfig(**limits))
    state = build_state(core, tokenizer, model_name="fake", vocab_size=vocab, settings=settings)
    return InProcessServer(state, settings)


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of ``r``, which must have ``status``."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]  # type: ignore[no-any-return]


def post_body(
    server: InProcessServer, path: str, content: bytes | str, **kw: Any
) -> httpx.Response:
    """``content`` as it is, as JSON: a body the client library would not send."""
    headers = {"content-type": "application/json"}
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=30, **kw)


def chat(server: InProcessServer, **body: Any) -> httpx.Response:
    """A small chat request with ``body``'s fields on top."""
    payload = {"messages": USER, "max_tokens": 4, **body}
    return httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=30)


def assert_healthy(server: InProcessServer) -> None:
    """What a refused request left behind: the server still answers and serves."""
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert chat(server).status_code == 200
