"""Chat messages as requests carry them (OpenAI's shape), shared by /v1/chat/completions and
/tokenize.

A message's content is a string, a list of text parts or, on an assistant turn that only made
tool calls, absent; the published schema says so too (an ``if``/``then`` on the role), so
schema-driven clients and fuzzers know it. Known fields are strict, unknown ones allowed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.config import JsonDict

# OpenAI's roles; "developer" is its newer name for "system" (and is rendered as system).
ROLES = ("system", "user", "assistant", "tool", "developer")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text"]
    text: str


_CONTENT_REQUIRED: JsonDict = {
    "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
    "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
}


# Each call names its function; its arguments are an object or JSON text (text/tool_calls.py).
_TOOL_CALLS: JsonDict = {
    "items": {
        "type": "object",
        "required": ["function"],
        "properties": {
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"type": ["string", "object"]},
                },
            }
        },
    }
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_CONTENT_REQUIRED)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # A string, a list of text parts or None (assistant messages that only carry tool calls).
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant turn's calls (OpenAI's shape) and a tool turn's answer to one: rendered by
    # the chat template (text/tokenizer.py), never dropped.
    tool_calls: list[dict[str, Any]] | None = Field(None, json_schema_extra=_TOOL_CALLS)
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or text parts)")
        return self

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, v: str) -> str:
        return "system" if v == "developer" else v
