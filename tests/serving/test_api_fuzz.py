"""Schemathesis against poise's own OpenAPI schema, every route (issue 16, item 1).

The server is the real app in this process (uvicorn, the Host check, the read deadlines, the
API key) around a tiny random Llama with the SmolLM2 tokenizer. Schemathesis generates valid
and invalid requests from ``/openapi.json`` and checks each answer against the schema (status
codes, content types, bodies, headers) plus our own contract: never a 5xx, and every error in
OpenAI's shape. After the fuzz, a plain request must still be served and the KV pool empty.

The default suite runs a few examples per route; ``-m slow`` runs the large budget.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.core.failures import FailureGroup
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from poise.config import EngineConfig
from poise.serving.server import build_state_from_config
from poise.serving.settings import ServerSettings
from tests.serving.conftest import InProcessServer

KEY = "fuzz-key"
MAX_MODEL_LEN = 128
# Examples per route: a few seconds in the default suite; POISE_FUZZ_EXAMPLES for a long run.
SMALL = 2
LARGE = int(os.environ.get("POISE_FUZZ_EXAMPLES", "400"))


@schemathesis.check
def openai_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """No 5xx; every 4xx is ``{"error": {"message", "type", "param", "code"}}``."""
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:300]}"
    if status >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert {"message", "type", "param", "code"} <= set(body["error"]), body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return None


# What a schema cannot say: a request's prompt, counted in tokens, must fit the window (with
# its max_tokens) and the KV pool, and must have one (a lone control character has none); a
# logit_bias key is a token id written as a string, which a
# schema cannot bound by the vocabulary; a choice the vocabulary cannot spell (a byte no token
# holds); text that must be JSON (a tool call's arguments, a JSON schema given as text); a JSON
# schema, regex or grammar that must compile; "auto" tool choice (the default with tools) on a
# server started without a tool-call parser; and rules
# across fields (max_tokens and max_completion_tokens agree, stream_options only with stream,
# min_tokens <= max_tokens, max_tokens 0 only with echo, top_logprobs only with logprobs,
# tool_choice only with tools, exactly one structured output constraint,
# guided_whitespace_pattern only with guided_json). A
# schema-valid request may be refused only for these.
_WINDOW = (
    "max_model_len",
    "KV cache",
    "prompt is empty",
    "logit_bias: token id",
    "no token of this model produces",
    "needs the server started with",
    "arguments are not JSON",
    "json schema is not valid JSON",
    "invalid json:",
    "invalid regex:",
    "invalid grammar:",
    "differ; give one",
    "only allowed when stream is true",
    "min_tokens must be in [0, max_tokens",
    "only allowed with echo",
    "echo with logprobs needs n = 1",
    "top_logprobs needs logprobs",
    "tool_choice needs tools",
    "exactly one of",
    "give one structured output constraint",
    "needs guided_json",
)


@schemathesis.check
def valid_requests_are_served(ctx: Any, response: Any, case: Any) -> bool | None:
    """Schemathesis' positive_data_acceptance, less the token-count limits above."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return None
    if response.status_code == 404:  # a model id in the path that is not a served name
        assert response.json()["error"]["code"] == "model_not_found", response.text
    elif response.status_code == 400:
        message = response.json()["error"]["message"]
        assert any(w in message for w in _WINDOW), f"schema-valid request refused: {message}"
    else:
        assert response.status_code < 300, f"{response.status_code}: {response.text[:300]}"
    return None


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path) -> Iterator[InProcessServer]:
    cfg = EngineConfig.from_kwargs(
        model=str(tiny_model_dir),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
        num_threads=1,
    )
    settings_ = ServerSettings(enable_api_docs=True, api_key=KEY)
    state = build_state_from_config(cfg, settings_)
    with InProcessServer(state, settings_) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(fuzz_server: InProcessServer) -> Any:
    return schemathesis.openapi.from_url(
        fuzz_server.base_url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}
    )


def _fuzz_operation(
    operation: Any, mode: GenerationMode, server: InProcessServer, examples: int
) -> Counter[str]:
    """``examples`` requests of ``mode`` to one route; the statuses seen."""
    statuses: Counter[str] = Counter()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case: Any) -> None:
        response = case.call_and_validate(
            base_url=server.base_url,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
            additional_checks=[openai_error_shape, valid_requests_are_served],
            excluded_checks=[positive_data_acceptance],
        )
        statuses[f"{operation.label} {response.status_code}"] += 1

    one()
    return statuses


def _fuzz_every_route(schema: Any, server: InProcessServer, examples: int) -> Counter[str]:
    """``examples`` valid and ``examples`` invalid requests per route; the statuses seen. Every
    route and mode runs even after one fails; the failures are reported together."""
    statuses: Counter[str] = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                statuses += _fuzz_operation(operation, mode, server, examples)
            except (AssertionError, FailureGroup) as exc:
                failures.append(f"{operation.label} ({mode}): {exc}")
            except Unsatisfiable:
                # A route without parameters or body has no invalid request to make.
                assert mode is GenerationMode.NEGATIVE and not operation.body, operation.label
    assert not failures, "\n\n".join(failures)
    return statuses


def test_every_route_small(api_schema: Any, fuzz_server: InProcessServer) -> None:
    statuses = _fuzz_every_route(api_schema, fuzz_server, SMALL)
    routes = {key.rsplit(" ", 1)[0] for key in statuses}
    assert len(routes) == len(list(api_schema.get_all_operations())) >= 10, routes
    assert not [key for key in statuses if key.rsplit(" ", 1)[1].startswith("5")], statuses


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_route_large(api_schema: Any, fuzz_server: InProcessServer) -> None:
    statuses = _fuzz_every_route(api_schema, fuzz_server, LARGE)
    print(f"fuzzed {sum(statuses.values())} requests: {dict(sorted(statuses.items()))}")


def test_still_serving_after_the_fuzz(fuzz_server: InProcessServer) -> None:
    r = httpx.post(
        fuzz_server.base_url + "/v1/chat/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}"},
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    core = fuzz_server.state.engine.core
    assert core.scheduler.kv_cache_usage == 0 and not core.has_unfinished_requests()


# ---- what the fuzz found: requests the schema called valid and the server refused ----------


def _post(server: InProcessServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        server.base_url + path, json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
    )


def test_the_schema_says_what_the_server_refuses(fuzz_server: InProcessServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    schema = httpx.get(fuzz_server.base_url + "/openapi.json", headers=auth).json()
    models = schema["components"]["schemas"]
    vocab = fuzz_server.state.generator.vocab_size
    # Token ids are below the vocabulary size, wherever a request gives them.
    for model, name in (
        ("CompletionRequest", "prompt"),
        ("DetokenizeRequest", "tokens"),
        ("ChatCompletionRequest", "stop_token_ids"),
    ):
        assert f'"maximum": {vocab - 1}' in json.dumps(models[model]["properties"][name])
    r = _post(fuzz_server, "/v1/completions", {"prompt": [vocab], "max_tokens": 1})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    # The model and the traffic class are the configured ones.
    names = fuzz_server.state.served_model_names
    assert names in [
        v.get("enum") for v in models["DetokenizeRequest"]["properties"]["model"]["anyOf"]
    ]
    assert ["interactive", "long"] in [  # the default chat classes
        v.get("enum") for v in models["CompletionRequest"]["properties"]["class"]["anyOf"]
    ]
    # Only an assistant turn may leave out its content; a content part is text.
    assert models["ChatMessage"]["then"]["required"] == ["content"]
    r = _post(fuzz_server, "/v1/chat/completions", {"messages": [{"role": "tool"}]})
    assert r.status_code == 400 and "needs content" in r.json()["error"]["message"]
    r = _post(
        fuzz_server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}], "max_tokens": 1},
    )
    assert r.status_code == 200, r.text
    # Refused values are out of the schema (continue_final_message).
    assert models["TokenizeRequest"]["properties"]["continue_final_message"]["enum"] == [False]
    assert len(models["TokenizeRequest"]["oneOf"]) == 2
    for body in ({}, {"messages": []}):
        assert _post(fuzz_server, "/tokenize", body).status_code == 400
    for path in ("/tokenize", "/detokenize"):
        assert {"400", "404", "413"} <= set(schema["paths"][path]["post"]["responses"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"ttft_slo_ms": True}, "ttft_slo_ms"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": True}, "max_tokens"),
        ({"ttft_slo_ms": 0}, "ttft_slo_ms"),
        ({"prompt": [[]]}, "prompt"),
    ],
)
def test_values_of_the_wrong_json_type_are_400_not_coerced(
    fuzz_server: InProcessServer, body: dict[str, Any], param: str
) -> None:
    """The fuzz found `"ttft_slo_ms": true` served as 1 ms: known fields are strict now."""
    r = _post(fuzz_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_integral_float_is_an_integer_as_json_says(fuzz_server: InProcessServer) -> None:
    r = _post(
        fuzz_server,
        "/v1/completions",
        {"prompt": [5.0, 6], "max_tokens": 3.0, "ignore_eos": True, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 3), usage
    assert (
        _post(fuzz_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2.5}).status_code
        == 400
    )
    assert _post(fuzz_server, "/tokenize", {"prompt": ""}).status_code == 400


@pytest.mark.parametrize("key", ["\u00b2", "\u0661", "1e3", "-1", ""])
def test_a_logit_bias_key_is_ascii_digits(fuzz_server: InProcessServer, key: str) -> None:
    """The fuzz sent "²" as a key: str.isdigit() took it and int() raised, a 500."""
    body = {"prompt": "hi", "max_tokens": 2, "logit_bias": {key: 1}}
    r = _post(fuzz_server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


# ---- hand-written beside the fuzz: shapes a generator rarely reaches ---------------------


def test_a_100k_message_chat_is_refused_quickly(fuzz_server: InProcessServer) -> None:
    messages = [{"role": "user", "content": "a"}] * 100_000  # ~3 MB, under the body limit
    started = time.monotonic()
    r = _post(fuzz_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text", "text": 5}],
        [{"type": "image_url", "image_url": {"url": "x"}}],
        [5],
        [{"text": "no type"}],
        {"type": "text", "text": "not a list"},
        7,
    ],
)
def test_content_parts_that_are_not_text_are_400(
    fuzz_server: InProcessServer, content: Any
) -> None:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    r = _post(fuzz_server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"add_special_tokens": True}, 200),
        ({"chat_template_kwargs": {"add_generation_prompt": 5}}, 400),
        ({"chat_template_kwargs": {"messages": 1}}, 400),
        ({"chat_template_kwargs": {"tokenize": True}}, 400),
        # Validated as the chat endpoint does (they used to reach the template as they were):
        ({"chat_template_kwargs": {"return_dict": True}}, 400),
        ({"chat_template_kwargs": {"documents": [{"x": 1}]}}, 400),
        ({"chat_template_kwargs": {"tokenizer": 1}}, 400),
        ({"chat_template_kwargs": {"enable_thinking": False}}, 200),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 200),
        ({"tools": [{}]}, 400),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, 400),
    ],
)
@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
def test_template_options_are_validated_alike_on_tokenize_and_chat(
    fuzz_server: InProcessServer, body: dict[str, Any], status: int, route: str
) -> None:
    """add_special_tokens with messages called a method transformers 5's tokenizers lack; a
    chat_template_kwargs key naming one of render_chat's arguments raised a TypeError; /tokenize
    took any ``tools`` and more ``chat_template_kwargs`` keys than the chat endpoint."""
    if route != "/tokenize" and "add_special_tokens" in body:
        return  # a /tokenize field
    messages = [{"role": "user", "content": "x"}]
    extra: dict[str, Any] = {}
    if route != "/tokenize":  # tools reach the template alone (auto choice needs a parser)
        extra = {"max_tokens": 1, **({"tool_choice": "none"} if "tools" in body else {})}
    r = _post(fuzz_server, route, {"messages": messages, **extra, **body})
    assert r.status_code == status, r.text
    if status == 400:
        param = r.json()["error"]["param"] or ""
        assert param.split(".")[0].split("[")[0] in ("chat_template_kwargs", "tools"), r.text
