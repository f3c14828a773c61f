"""Tool calls through the official openai client against `poise serve --enable-auto-tool-choice
--tool-call-parser hermes` on a tiny random Llama: forced calls (a named function, required)
come back as valid ``tool_calls`` streamed and not; ``auto`` parses the model's Hermes calls
(here made certain by a grammar); ``none`` is text; conversations with tool calls and tool
answers are accepted; per-request ``chat_template`` / ``chat_template_kwargs``; the
embedded SmolLM2 makes a forced call too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.serving.conftest import ServerProcess
from tests.structured.conftest import client, serve

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
PARAMS = {"get_weather": WEATHER, "add": ADD}
MSG = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def _server(args: list[str], log: Path) -> Iterator[ServerProcess]:
    yield from serve(
        [
            *args,
            "--max-model-len",
            "1024",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ],
        log,
    )


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server([str(tiny_model_dir)], tmp_path_factory.mktemp("tc") / "server.log")


def _client(server: ServerProcess) -> openai.OpenAI:
    return client(server)


def _calls(
    client: openai.OpenAI, stream: bool, **kw: Any
) -> tuple[list[dict[str, Any]], str | None, str | None]:
    """(tool calls as dicts, content, finish_reason), streamed deltas merged as a client does."""
    kw = {"model": "m", "messages": MSG, "tools": TOOLS, "max_tokens": 200, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    merged: dict[int, dict[str, Any]] = {}
    content, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                call = merged.setdefault(
                    d.index,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["function"]["name"] += d.function.name or ""
                    call["function"]["arguments"] += d.function.arguments or ""
    return [merged[i] for i in sorted(merged)], content or None, reason


def _check(calls: list[dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_is_forced(tiny: ServerProcess, stream: bool) -> None:
    for seed in range(2):
        choice = {"type": "function", "function": {"name": "add"}}
        calls, content, reason = _calls(
            _client(tiny), stream, tool_choice=choice, temperature=1.0, seed=seed
        )
        _check(calls)
        assert [c["function"]["name"] for c in calls] == ["add"]
        assert content is None and reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_required_is_forced(tiny: ServerProcess, stream: bool) -> None:
    for seed in range(2):
        calls, content, reason = _calls(
            _client(tiny), stream, tool_choice="required", temperature=1.0, seed=seed
        )
        _check(calls)
        assert content is None and reason == "tool_calls"
    calls, _, _ = _calls(
        _client(tiny), stream, tool_choice="required", temperature=0.0, parallel_tool_calls=False
    )
    _check(calls)
    assert len(calls) == 1


# A grammar that makes the random model write a Hermes call, so "auto" has one to parse.
HERMES = r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_calls(tiny: ServerProcess, stream: bool) -> None:
    calls, content, reason = _calls(
        _client(tiny),
        stream,
        temperature=1.0,
        seed=7,
        extra_body={"structured_outputs": {"regex": HERMES}},
    )
    _check(calls)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert content == "Sure. " and reason == "tool_calls"
    # Without a call in the text, auto is plain text.
    calls, content, reason = _calls(
        _client(tiny),
        stream,
        max_tokens=8,
        temperature=0.0,
        extra_body={"guided_regex": "[a-z ]{3,20}"},
    )
    assert calls == [] and content and reason in ("stop", "length")


def test_none_is_text_and_bad_choices_are_400(tiny: ServerProcess) -> None:
    client = _client(tiny)
    calls, content, _ = _calls(client, False, tool_choice="none", max_tokens=8)
    assert calls == [] and content is not None
    for body in (
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": None, "tool_choice": "required"},
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                **{"model": "m", "messages": MSG, "tools": TOOLS, "max_tokens": 4, **body}
            )
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "tool_choice"


def test_tool_turns_are_rendered_not_dropped(tiny: ServerProcess) -> None:
    convo = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 3}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny, 21 C"},
    ]
    body = {"model": "m", "messages": convo, "tools": TOOLS}
    tok = httpx.post(tiny.base_url + "/tokenize", json=body).json()
    text = httpx.post(tiny.base_url + "/detokenize", json={"tokens": tok["tokens"]}).json()[
        "prompt"
    ]
    assert '{"city": "Paris", "days": 3}' in text and "sunny, 21 C" in text
    assert '"name": "add"' in text  # the tools, in the system block SmolLM2's template lacks
    resp = _client(tiny).chat.completions.create(
        model="m",
        messages=convo,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=4,
    )
    assert resp.usage is not None and resp.usage.prompt_tokens == tok["count"]


def test_per_request_chat_template_and_kwargs(tiny: ServerProcess) -> None:
    client = _client(tiny)
    template = "{{ messages[0].content }}{% if shout %}!!!{% endif %}"
    content = "one two three"
    count = httpx.post(
        tiny.base_url + "/tokenize",
        json={"model": "m", "prompt": content + "!!!", "add_special_tokens": False},
    ).json()["count"]
    resp = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": content}],
        max_tokens=2,
        extra_body={"chat_template": template, "chat_template_kwargs": {"shout": True}},
    )
    assert resp.usage is not None and resp.usage.prompt_tokens == count
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m",
            messages=MSG,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"tokenize": True}},
        )
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == "chat_template_kwargs"


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server([], tmp_path_factory.mktemp("tc-embedded") / "server.log")


def test_embedded_model_forced_call(embedded: ServerProcess) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        calls, _, reason = _calls(_client(embedded), stream, tool_choice=choice, temperature=0.0)
        _check(calls)
        assert reason == "tool_calls"
