"""Tool calls as text: parsing a model's calls (vLLM's ``--tool-call-parser``) and the schemas
that force one (``tool_choice`` ``required`` or a named function).

- ``HermesToolParser``: calls written as ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` (Hermes, Qwen2.5, and the block ``tools_system_prompt`` teaches a model whose
  template knows no tools). ``extract`` parses a whole reply; ``feed`` parses a stream: text
  outside the tags is released as soon as it cannot be the start of a tag, and each call as
  soon as its closing tag arrives. A block that is not valid JSON stays text (as vLLM).
- ``forced_schema`` / ``forced_calls``: what structured output must produce for ``required``
  (a JSON array of ``{"name", "parameters"}``, one of the tools each, as vLLM) or for a named
  function (its arguments object), and the ``ToolCall``s read back from that output.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from poise.errors import InvalidRequestError


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:  # stream deltas carry the call's index
            out["index"] = index
        return out


def _call_from_json(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], arguments)


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self.num_calls = 0

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; content is None when only whitespace is left."""
        content, calls = self.feed(text, final=True)
        return (content if content.strip() else None), calls

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """Content that is safe to emit now and the calls completed by ``text``."""
        self._buffer += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._inside:
                start = self._buffer.find(self.START)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, self.START)
                    self._text(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                self._text(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(self.START) :]
                self._inside = True
            end = self._buffer.find(self.END)
            if end < 0 and not final:
                break
            body = self._buffer if end < 0 else self._buffer[:end]
            self._buffer = "" if end < 0 else self._buffer[end + len(self.END) :]
            self._inside = False
            call = _call_from_json(body.strip())
            if call is None:  # not a call after all: give the text back as it was
                out.append(self.START + body + ("" if end < 0 else self.END))
            else:
                calls.append(call)
                self.num_calls += 1
            if end < 0:
                break
        return "".join(out), calls

    def _text(self, out: list[str], text: str) -> None:
        # The whitespace around calls (newlines between tags) is not content.
        if text and not (self.num_calls and not text.strip()):
            out.append(text)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back from a stream)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS = {"hermes": HermesToolParser}


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tool block for a chat template that ignores ``tools`` (SmolLM2's, for one): the
    functions' signatures and the Hermes call format, which ``HermesToolParser`` reads."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou can call the functions whose signatures are listed in <tools></tools>:\n"
        f"<tools>\n{signatures}\n</tools>\n\nTo call one, answer with a JSON object holding its "
        "name and its arguments between <tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>'
    )


def tool_calls_as_text(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's OpenAI ``tool_calls`` written in the Hermes format, for a template
    that only renders ``content``."""
    blocks = []
    for call in calls:
        fn = call.get("function", {})
        blocks.append(
            "<tool_call>\n"
            + json.dumps(
                {"name": fn.get("name"), "arguments": fn.get("arguments", {})}, ensure_ascii=False
            )
            + "\n</tool_call>"
        )
    return "\n".join(blocks)


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in tools}


def forced_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool = True) -> Any:
    """The JSON schema structured output enforces: the named function's parameters, or (name
    None: ``required``) an array of one or more ``{"name", "parameters"}`` calls."""
    functions = _functions(tools)
    if name is not None:
        return functions[name].get("parameters") or {"type": "object", "properties": {}}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [n]},
                "parameters": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for n, f in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, name: str | None) -> list[ToolCall]:
    """The calls in the output that ``forced_schema(..., name)`` constrained. A named call's
    arguments are the text as it is (cut, like OpenAI's, when finish_reason is ``length``); a
    ``required`` array cut before its end gives no calls (the text stays the content)."""
    if name is not None:
        return [ToolCall(name, text)]
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def tool_fields(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A chat message's tool fields, validated: ``tool_calls`` (each call's JSON ``arguments``
    text parsed into an object, as chat templates expect), ``tool_call_id``, ``name``."""
    out: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise InvalidRequestError(f"messages[{index}].tool_calls must be a list", "messages")
        out["tool_calls"] = [_template_call(c, index) for c in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _template_call(call: Any, index: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(
            f"messages[{index}].tool_calls: each call needs function.name", "messages"
        )
    args = fn.get("arguments", {})
    if not isinstance(args, str | Mapping):  # the schema's type: an object or JSON text
        raise InvalidRequestError(
            f"messages[{index}].tool_calls: arguments must be an object or JSON text, not "
            f"{type(args).__name__}",
            "messages",
        )
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise InvalidRequestError(
                f"messages[{index}].tool_calls: arguments are not JSON ({exc})", "messages"
            ) from exc
    return {**call, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def for_template(
    template: str, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``conversation`` as a template that may not know tools can render it. A template that
    never reads ``tools`` gets them as a system block (``tools_system_prompt``); one that never
    reads ``tool_calls`` gets an assistant turn's calls written into its content (Hermes
    format). Either way nothing the client sent is dropped."""
    out = [dict(m) for m in conversation]
    if "tool_calls" not in template:
        for m in out:
            if m.get("tool_calls"):
                text = tool_calls_as_text(m.pop("tool_calls"))
                m["content"] = f"{m['content']}\n{text}" if m["content"] else text
    if tools and "tools" not in template:
        block = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
