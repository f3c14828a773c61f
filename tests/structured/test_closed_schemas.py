"""Closed objects by default (issue 38): a schema's objects hold only the properties they
declare, at every level, unless the schema or the one switch (``--allow-additional-properties``,
or a request's ``disable_additional_properties: false``) says otherwise. Unit checks of the
schema walk, then the defect as a client met it: the embedded SmolLM2 forced to call a function
whose parameters do not say ``additionalProperties`` kept adding keys until ``max_tokens``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from poise.core.structured import StructuredOutputsParams
from poise.text.json_schema import close_objects
from tests.serving.conftest import ServerProcess
from tests.structured.conftest import client, serve

# No additionalProperties anywhere: the JSON Schema default would allow any extra key. The
# string is bounded so that what is tested is the object rule, not a sampled string's length
# (unbounded, the same ten seeds also gave parsed, declared-only arguments in a run).
OPEN = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "when": {
            "type": "object",
            "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
        },
    },
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": OPEN},
    }
]
MSG = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def test_every_object_without_a_word_is_closed() -> None:
    closed = close_objects(OPEN)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["when"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["city"]  # not an object
    assert "additionalProperties" not in OPEN  # a copy: the request's schema is untouched
    nested = {
        "type": "array",
        "items": {"properties": {"a": {"type": "object"}}},
        "$defs": {"d": {"type": ["object", "null"]}},
        "anyOf": [{"type": "object"}, {"type": "string"}],
    }
    out = close_objects(nested)
    assert out["items"]["additionalProperties"] is False
    assert out["items"]["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert (
        out["anyOf"][0]["additionalProperties"] is False
        and "additionalProperties" not in (out["anyOf"][1])
    )


def test_what_a_schema_says_is_kept() -> None:
    given = {
        "type": "object",
        "additionalProperties": True,
        "properties": {"m": {"type": "object", "additionalProperties": {"type": "object"}}},
    }
    out = close_objects(given)
    assert out["additionalProperties"] is True
    assert out["properties"]["m"]["additionalProperties"] == {
        "type": "object",
        "additionalProperties": False,
    }
    # allOf members stay open at their top (closing each would forbid the others' keys).
    both = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}},
            {"type": "object", "properties": {"b": {"type": "object"}}},
        ]
    }
    out = close_objects(both)
    assert "additionalProperties" not in out and "additionalProperties" not in out["allOf"][0]
    assert out["allOf"][1]["properties"]["b"]["additionalProperties"] is False


def test_the_switch_is_part_of_the_cache_key() -> None:
    keys = {
        StructuredOutputsParams(json=OPEN, disable_additional_properties=v).options()
        for v in (None, True, False)
    }
    assert len(keys) == 3


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("closed") / "server.log"
    yield from serve(["--max-model-len", "1024", "--max-num-seqs", "10"], log)


def _arguments(server: ServerProcess, tool_choice: Any, seed: int) -> tuple[list[str], str]:
    choice = (
        client(server)
        .chat.completions.create(
            model="m",
            messages=MSG,
            tools=TOOLS,
            tool_choice=tool_choice,  # type: ignore[arg-type]
            max_tokens=128,
            temperature=0.7,
            seed=seed,
        )
        .choices[0]
    )
    return [c.function.arguments for c in choice.message.tool_calls or []], str(
        choice.finish_reason
    )


def _declared_only(args: dict[str, Any]) -> None:
    assert set(args) <= {"city", "when"} and "city" in args, args
    assert set(args.get("when", {})) <= {"days"}, args


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"]
)
def test_forced_calls_parse_and_hold_declared_properties(
    embedded: ServerProcess, tool_choice: Any
) -> None:
    with ThreadPoolExecutor(10) as pool:  # one batch: ten seeds at once
        results = list(pool.map(lambda s: _arguments(embedded, tool_choice, s), range(10)))
    for arguments, reason in results:
        assert reason == "tool_calls", results  # finished, not cut at max_tokens
        assert arguments, results
        for text in arguments:
            _declared_only(json.loads(text))


def test_the_request_switch_reopens_objects(embedded: ServerProcess) -> None:
    # With the JSON Schema default back, extra keys are allowed again (the old behaviour): the
    # request is accepted and its output is still JSON that starts as the schema says.
    resp = client(embedded).completions.create(
        model="m",
        prompt="A forecast as JSON:",
        max_tokens=24,
        temperature=0,
        extra_body={"structured_outputs": {"json": OPEN, "disable_additional_properties": False}},
    )
    assert resp.choices[0].text.startswith('{"city":')
