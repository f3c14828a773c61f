"""Tool calls as text: the Hermes parser (whole and streamed at every split), the forced-call
schemas, and how a conversation with tools, tool calls and tool answers reaches a template
that knows none of them (SmolLM2's) and one that knows them all."""

from __future__ import annotations

import json

import jsonschema
import pytest

from poise.errors import InvalidRequestError
from poise.text.tokenizer import load_tokenizer, render_chat
from poise.text.tool_calls import (
    HermesToolParser,
    ToolCall,
    for_template,
    forced_calls,
    forced_schema,
    tool_fields,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
REPLY = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
)


def _names_args(calls: list[ToolCall]) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_whole_reply() -> None:
    content, calls = HermesToolParser().extract(REPLY)
    assert content == "Let me check. "
    assert _names_args(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("call_")
    assert HermesToolParser().extract("no calls here") == ("no calls here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert HermesToolParser().extract(broken) == (broken, [])  # stays text, as vLLM
    only = HermesToolParser().extract('<tool_call>{"name": "add", "arguments": {}}</tool_call>')
    assert only[0] is None and _names_args(only[1]) == [("add", {})]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11])
def test_hermes_streamed_at_every_split_gives_the_same(size: int) -> None:
    parser = HermesToolParser()
    content, calls = "", []
    pieces = [REPLY[i : i + size] for i in range(0, len(REPLY), size)]
    for i, piece in enumerate(pieces):
        text, new = parser.feed(piece, final=i == len(pieces) - 1)
        assert "<" not in text  # a tag's beginning is held back, never released as content
        content += text
        calls += new
    assert content == "Let me check. "
    assert _names_args(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


def test_hermes_stream_releases_a_false_start_and_an_unclosed_call() -> None:
    parser = HermesToolParser()
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("s are> b") == ("<tools are> b", [])
    parser = HermesToolParser()
    assert parser.feed('<tool_call>{"name": "add", "arguments": {"a": 1}}') == ("", [])
    content, calls = parser.feed("", final=True)  # EOS before the closing tag: still a call
    assert content == "" and _names_args(calls) == [("add", {"a": 1})]


def test_forced_schemas_and_calls() -> None:
    named = forced_schema(TOOLS, "add")
    assert named == TOOLS[1]["function"]["parameters"]
    required = forced_schema(TOOLS, None)
    good = [
        {"name": "add", "parameters": {"a": 1, "b": 2}},
        {"name": "get_weather", "parameters": {"city": "Oslo"}},
    ]
    jsonschema.validate(good, required)
    for bad in (
        [],
        [{"name": "add", "parameters": {"city": "x"}}],
        [{"name": "nope", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    assert forced_schema(TOOLS, None, parallel=False)["maxItems"] == 1
    assert _names_args(forced_calls(json.dumps(good), None)) == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert forced_calls('[{"name": "add", "param', None) == []  # cut by max_tokens
    assert _names_args(forced_calls('{"a": 3, "b": 4}', "add")) == [("add", {"a": 3, "b": 4})]


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_a_template_without_tools_gets_them_as_text() -> None:
    tok = load_tokenizer(None)  # SmolLM2: its template reads only role and content
    assert "tools" not in tok.chat_template
    text = render_chat(tok, CONVERSATION, tools=TOOLS)
    assert "<|im_start|>system\n# Tools" in text and '"name": "get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' in text
    assert '{"city": "Paris"}' in text
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in text
    # A system message keeps its text; the tool block follows it.
    with_system = render_chat(
        tok, [{"role": "system", "content": "Be brief."}, *CONVERSATION], tools=TOOLS
    )
    assert "<|im_start|>system\nBe brief.\n\n# Tools" in with_system


TOOL_TEMPLATE = (
    "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments.city }})"
    "{% endfor %}{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{% endfor %}"
)


def test_a_template_with_tools_gets_the_fields_with_arguments_as_objects() -> None:
    tok = load_tokenizer(None)
    text = render_chat(
        tok, CONVERSATION, tools=TOOLS, chat_template=TOOL_TEMPLATE, add_generation_prompt=False
    )
    assert text == (
        "[tool get_weather][tool add][user]Weather in Paris?[assistant]"
        "(call get_weather Paris)[tool]18 C, sunny(for call_1)"
    )
    assert for_template(TOOL_TEMPLATE, [{"role": "user", "content": "x"}], TOOLS) == [
        {"role": "user", "content": "x"}
    ]


@pytest.mark.parametrize("arguments", [7, [1, 2], True, None])
def test_tool_call_arguments_other_than_an_object_or_json_text_are_refused(
    arguments: object,
) -> None:
    # The published schema says object or string; an integer was rendered as it came (the large
    # API fuzz run found /tokenize accepting it).
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "add", "arguments": arguments}}],
    }
    with pytest.raises(InvalidRequestError, match="arguments must be an object or JSON text"):
        tool_fields(message, 0)
    ok = {**message, "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 1}'}}]}
    assert tool_fields(ok, 0)["tool_calls"][0]["function"]["arguments"] == {"a": 1}
