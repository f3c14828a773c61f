"""Input a hostile or careless client sends (issue 20, items 1, 2, 3, 6, 7, 9): each is refused
in OpenAI's error shape with the right status, before it costs the server anything.

The real app, AsyncEngine and SmolLM2 tokenizer, with the scheduler tests' deterministic fake
executor (no model), in this process (limits_server.py), one for the module; the tests that
need a server of their own (memory, the tokenizer's time) are in test_hostile_input_cost.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from poise.serving.settings import RequestLimitsConfig
from poise.text import apply_chat_template
from tests.serving.conftest import InProcessServer
from tests.serving.limits_server import (
    MAX_MODEL_LEN,
    USER,
    assert_healthy,
    chat,
    limits_server,
    openai_error,
    post_body,
)


@pytest.fixture(scope="module")
def server(smol_tokenizer: Any) -> Iterator[InProcessServer]:
    with limits_server(smol_tokenizer, max_request_body_bytes=256 * 1024) as s:
        yield s


# ---- 1. request size ---------------------------------------------------------------------


def test_body_over_the_limit_is_413_whether_sized_or_chunked(server: InProcessServer) -> None:
    big = json.dumps({"prompt": "x" * 300_000, "max_tokens": 1}).encode()
    err = openai_error(post_body(server, "/v1/completions", big), 413)
    assert "262144" in err["message"] and "--max-request-body-bytes" in err["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding chunked
        for i in range(0, len(big), 16_384):
            yield big[i : i + 16_384]

    err = openai_error(post_body(server, "/v1/completions", chunks()), 413)  # type: ignore[arg-type]
    assert "more than 262144 bytes" in err["message"]
    small = json.dumps({"prompt": "x" * 1000, "max_tokens": 1}).encode()
    assert post_body(server, "/v1/completions", small).status_code == 200
    assert_healthy(server)


# ---- 2. stop strings ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "flag"),
    [
        ({"stop": [f"s{i}" for i in range(17)]}, "stop", "--max-stop-sequences"),
        ({"stop": "z" * 257}, "stop", "--max-stop-sequence-chars"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids", "--max-stop-token-ids"),
    ],
)
def test_stop_limits_are_400_naming_the_limit(
    server: InProcessServer, body: dict[str, Any], param: str, flag: str
) -> None:
    err = openai_error(chat(server, **body), 400)
    assert err["param"] == param and flag in err["message"]


def test_stop_strings_at_the_limits_are_served(server: InProcessServer) -> None:
    stops = ["q" * 255 + "!"] + [f"never{i}" for i in range(15)]
    r = chat(server, stop=stops, max_tokens=30, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30


# ---- 3. lone surrogates ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "stream": true, "stop": "\\udfff"}',
            "stop",
        ),
        ("/v1/completions", '{"prompt": "x\\ud800", "max_tokens": 2}', "prompt"),
        (
            "/v1/completions",
            '{"prompt": "x", "stream": true, "max_tokens": 2, "user": "\\ud83d"}',
            "user",
        ),
    ],
)
def test_a_lone_surrogate_is_400(server: InProcessServer, path: str, raw: str, param: str) -> None:
    err = openai_error(post_body(server, path, raw), 400)
    assert err["param"] == param and "surrogate" in err["message"]


def test_a_surrogate_pair_is_text(server: InProcessServer) -> None:
    raw = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    assert post_body(server, "/v1/chat/completions", raw).status_code == 200


# ---- 6. values that must be refused ------------------------------------------------------


@pytest.mark.parametrize(
    ("fragment", "param"),
    [
        ('"temperature": NaN', "temperature"),
        ('"temperature": Infinity', "temperature"),
        ('"temperature": 1e-45', "temperature"),
        ('"temperature": 0.000009', "temperature"),
        ('"top_p": NaN', "top_p"),
        ('"min_p": NaN', "min_p"),
        ('"presence_penalty": -Infinity', "presence_penalty"),
        ('"max_tokens": 1e12', "max_tokens"),
        ('"max_completion_tokens": 1020', "max_completion_tokens"),
    ],
)
def test_sampling_values_that_cannot_be_honoured_are_400(
    server: InProcessServer, fragment: str, param: str
) -> None:
    raw = '{"messages": [{"role": "user", "content": "hi"}], ' + fragment + "}"
    err = openai_error(post_body(server, "/v1/chat/completions", raw), 400)
    assert err["param"] == param
    if "max" in param:  # names the request, the prompt and the window
        assert str(MAX_MODEL_LEN) in err["message"] and "prompt has" in err["message"]


def test_temperature_at_the_documented_minimum_and_max_tokens_that_fit_are_served(
    server: InProcessServer, smol_tokenizer: Any
) -> None:
    n_prompt = len(apply_chat_template(smol_tokenizer, USER))
    r = chat(server, temperature=1e-5, max_tokens=MAX_MODEL_LEN - n_prompt, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN


def test_roles_unknown_to_openai_are_400_and_developer_is_system(
    server: InProcessServer, smol_tokenizer: Any
) -> None:
    err = openai_error(chat(server, messages=[{"role": "wizard", "content": "hi"}]), 400)
    assert err["param"] == "messages" and "developer" in err["message"]
    developer = chat(server, messages=[{"role": "developer", "content": "Be terse."}, *USER])
    as_system = [{"role": "system", "content": "Be terse."}, *USER]
    assert developer.status_code == 200
    n_prompt = len(apply_chat_template(smol_tokenizer, as_system))
    assert developer.json()["usage"]["prompt_tokens"] == n_prompt


# ---- 7. errors outside OpenAI's shape ----------------------------------------------------


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"prompt": "caf\xe9", "max_tokens": 1}', "UTF-8"),
        (b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "nested too deeply"),
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "too long"),
        (b'{"prompt": "x", "max_tokens": 2', "malformed JSON"),
    ],
)
def test_bodies_json_loads_chokes_on_are_400(
    server: InProcessServer, content: bytes, needle: str
) -> None:
    assert needle in openai_error(post_body(server, "/v1/completions", content), 400)["message"]


def test_unknown_routes_and_wrong_methods_answer_in_openai_shape(server: InProcessServer) -> None:
    err = openai_error(httpx.get(server.base_url + "/v1/nope"), 404)
    assert "/v1/nope" in err["message"]
    r = httpx.get(server.base_url + "/v1/chat/completions")
    assert "POST" in openai_error(r, 405)["message"] and r.headers["allow"] == "POST"
    openai_error(httpx.post(server.base_url + "/health"), 405)


def test_any_model_id_in_the_path_is_model_not_found(server: InProcessServer) -> None:
    # Starlette's :path stops at a newline: such an id was the unknown-route 404 (found by the
    # large API fuzz run); slashes are allowed (Hub ids).
    for model_id in ("nope", "org/nope", ",kZ%0Ap", "%0A"):
        err = openai_error(httpx.get(server.base_url + "/v1/models/" + model_id), 404)
        assert err["code"] == "model_not_found", (model_id, err)


def test_a_suffix_is_400_naming_it_and_the_schema_says_so(server: InProcessServer) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "suffix": "x"})
    err = openai_error(r, 400)
    assert err["param"] == "suffix" and "not supported" in err["message"], err
    ok = httpx.post(server.base_url + "/v1/completions", json={**body, "suffix": ""})
    assert ok.status_code == 200, ok.text
    schemas = httpx.get(server.base_url + "/openapi.json").json()["components"]["schemas"]
    suffix = schemas["CompletionRequest"]["properties"]["suffix"]["anyOf"][0]
    assert suffix["maxLength"] == 0, suffix  # the large API fuzz run: "x" was schema-valid


def test_an_empty_guided_choice_is_400_naming_it(server: InProcessServer) -> None:
    # The schema allowed [] and the grammar compiler then refused it; now both say minItems 1.
    err = openai_error(chat(server, guided_choice=[]), 400)
    assert err["param"] == "guided_choice", err
    schemas = httpx.get(server.base_url + "/openapi.json").json()["components"]["schemas"]
    choice = schemas["ChatCompletionRequest"]["properties"]["guided_choice"]["anyOf"][0]
    assert choice["minItems"] == 1, choice


# ---- 9. the published schema -------------------------------------------------------------


def test_openapi_schema_matches_what_the_server_answers(server: InProcessServer) -> None:
    schema = httpx.get(server.base_url + "/openapi.json").json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in json.dumps(schema)
    models = schema["components"]["schemas"]
    for path, ok in (
        ("/v1/chat/completions", "ChatCompletionResponse"),
        ("/v1/completions", "CompletionResponse"),
    ):
        responses = schema["paths"][path]["post"]["responses"]
        assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith(ok)
        assert "text/event-stream" in responses["200"]["content"]
        for status in ("400", "413", "429", "500", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse")
    chat, completion = models["ChatCompletionRequest"], models["CompletionRequest"]
    assert chat["properties"]["messages"]["minItems"] == 1
    assert chat["properties"]["n"]["maximum"] == 128 and chat["properties"]["n"]["minimum"] == 1
    bias = next(v for v in chat["properties"]["logit_bias"]["anyOf"] if v.get("type") == "object")
    assert bias["maxProperties"] == 300
    roles = models["ChatMessage"]["properties"]["role"]["enum"]
    assert set(roles) == {"system", "user", "assistant", "tool", "developer"}
    variants = completion["properties"]["prompt"]["anyOf"]
    assert variants[0]["minLength"] == 1 and all(v.get("minItems") == 1 for v in variants[1:])
    temperature = next(
        v for v in chat["properties"]["temperature"]["anyOf"] if v.get("type") == "number"
    )
    assert temperature["minimum"] == 0
    assert chat["properties"]["temperature"]["not"]["exclusiveMaximum"] == 1e-5
    # The running server's limits (the module server's defaults) are in the schema.
    stop = completion["properties"]["stop"]["anyOf"]
    assert stop[0]["maxLength"] == 256 and stop[1]["maxItems"] == 16
    ids = chat["properties"]["stop_token_ids"]["anyOf"][0]
    assert ids["maxItems"] == 256 and ids["items"]["minimum"] == 0
    assert chat["properties"]["max_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN - 1
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]


def test_limit_flags_reach_the_config() -> None:
    import argparse

    from poise.cli.options import config_from_args
    from poise.cli.serve import add_request_limit_args

    parser = argparse.ArgumentParser()
    add_request_limit_args(parser)
    args = parser.parse_args(["--max-request-body-bytes", "1MiB", "--max-stop-sequences", "4"])
    limits = config_from_args(RequestLimitsConfig, args)
    assert limits.max_request_body_bytes == 2**20 and limits.max_stop_sequences == 4
    assert limits.max_stop_sequence_chars == RequestLimitsConfig().max_stop_sequence_chars
    with pytest.raises(ValueError, match="max_stop_sequences"):
        config_from_args(RequestLimitsConfig, parser.parse_args(["--max-stop-sequences", "0"]))
