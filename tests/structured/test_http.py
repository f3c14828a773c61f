"""Structured output through the official openai client against `poise serve`: OpenAI's
``response_format`` (json_schema, json_object) and vLLM's ``structured_outputs`` / ``guided_*``
extensions, streaming and not, greedy and random, on a tiny random Llama (which never writes
JSON by itself) and on the embedded SmolLM2; a bad schema is a 400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.serving.conftest import ServerProcess
from tests.structured.conftest import client, serve
from tests.structured.schemas import SCHEMAS

MSG = [{"role": "user", "content": "Describe a person as a JSON object with a name and an age."}]


def _server(args: list[str], log: Path) -> Iterator[ServerProcess]:
    yield from serve([*args, "--max-model-len", "512"], log)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server([str(tiny_model_dir)], tmp_path_factory.mktemp("so") / "server.log")


def _client(server: ServerProcess) -> openai.OpenAI:
    return client(server)


def _schema_format(name: str) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }


def _chat(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str, str | None]:
    """(text, finish_reason) of one chat completion, streamed or not."""
    if not stream:
        resp = client.chat.completions.create(model="m", messages=MSG, **kw)  # type: ignore[arg-type]
        return resp.choices[0].message.content or "", resp.choices[0].finish_reason
    chunks = client.chat.completions.create(model="m", messages=MSG, stream=True, **kw)  # type: ignore[arg-type]
    text, reason = "", None
    for chunk in chunks:
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_validates_every_time(tiny: ServerProcess, name: str, stream: bool) -> None:
    client = _client(tiny)
    for seed in range(2):
        text, reason = _chat(
            client,
            stream,
            response_format=_schema_format(name),
            temperature=1.0,
            seed=seed,
            max_tokens=128,
        )
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    text, reason = _chat(
        client, stream, response_format=_schema_format(name), temperature=0.0, max_tokens=128
    )
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_vllm_extensions_and_completions(tiny: ServerProcess) -> None:
    client = _client(tiny)
    text, _ = _chat(
        client,
        False,
        max_tokens=16,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert text in ("yes", "no")
    text, _ = _chat(
        client,
        True,
        max_tokens=16,
        temperature=1.0,
        seed=2,
        extra_body={"guided_regex": r"\d{3}-[a-z]{2}"},
    )
    assert re.fullmatch(r"\d{3}-[a-z]{2}", text)
    text, _ = _chat(
        client, False, max_tokens=64, temperature=0.0, extra_body={"guided_json": SCHEMAS["person"]}
    )
    jsonschema.validate(json.loads(text), SCHEMAS["person"])
    resp = client.completions.create(
        model="m",
        prompt="x",
        max_tokens=64,
        temperature=1.0,
        seed=4,
        extra_body={"structured_outputs": {"json": SCHEMAS["nested"]}},
    )
    jsonschema.validate(json.loads(resp.choices[0].text), SCHEMAS["nested"])
    resp = client.completions.create(
        model="m", prompt="x", max_tokens=32, extra_body={"guided_grammar": 'start: "a" "b"* "c"'}
    )
    assert re.fullmatch("ab*c", resp.choices[0].text) or resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            },
            "response_format",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "[a-z"}}}, "structured_outputs"),
        ({"extra_body": {"guided_json": {"type": 3}}}, "guided_json"),
        ({"extra_body": {"guided_grammar": "start: nope"}}, "guided_grammar"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
            "guided_regex",
        ),
        (
            {"extra_body": {"guided_decoding_backend": "xgrammar", "guided_regex": "a"}},
            "guided_decoding_backend",
        ),
    ],
)
def test_invalid_constraints_are_400_naming_the_field(
    tiny: ServerProcess, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _client(tiny).chat.completions.create(model="m", messages=MSG, max_tokens=4, **body)  # type: ignore[call-overload]
    assert info.value.status_code == 400
    err = info.value.body
    assert isinstance(err, dict) and err.get("param") == param, err
    # The server keeps serving.
    assert _chat(_client(tiny), False, max_tokens=2)[1] is not None


def test_a_grammar_the_vocabulary_cannot_complete_is_400(tiny: ServerProcess) -> None:
    """No token of SmolLM2's vocabulary spells 0x04; here it comes after alternatives, so it
    is found while generating: a 400 naming the field, or in a stream that had started an
    error event with code 400 (was a 500, or a "stop" whose text broke the grammar)."""
    body = {
        "model": "m",
        "messages": MSG,
        "max_tokens": 8,
        "temperature": 0,
        "guided_regex": "(a|b)\x04",
    }
    r = httpx.post(tiny.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_regex" and err["type"] == "invalid_request_error", err
    assert "no token of this model produces" in err["message"]
    with httpx.stream(
        "POST", tiny.base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]", events
    err = json.loads(events[-2])["error"]
    assert err["code"] == 400 and err["param"] == "guided_regex", err
    assert _chat(_client(tiny), False, max_tokens=2)[1] is not None  # still serving


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server([], tmp_path_factory.mktemp("so-embedded") / "server.log")


def test_embedded_model(embedded: ServerProcess) -> None:
    client = _client(embedded)
    for stream, seed in ((False, 5), (True, 6)):
        text, reason = _chat(
            client,
            stream,
            response_format=_schema_format("person"),
            temperature=0.7,
            seed=seed,
            max_tokens=64,
        )
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMAS["person"])
    text, reason = _chat(
        client, True, response_format={"type": "json_object"}, temperature=0.0, max_tokens=100
    )
    assert reason == "stop" and isinstance(json.loads(text), dict), text
