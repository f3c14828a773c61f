"""Tool calls over HTTP: the chat request's ``tools`` / ``tool_choice`` and the replies'
``tool_calls`` (OpenAI's shapes), with vLLM's rules.

- ``tool_choice`` ``none``: the tools reach the chat template; the reply is text.
- ``auto`` (the default when ``tools`` are given, as vLLM): the model decides; its text is
  parsed by the server's ``--tool-call-parser`` (needs ``--enable-auto-tool-choice``, else a
  400 naming ``tool_choice``, as vLLM answers).
- ``required`` / ``{"type": "function", "function": {"name": ...}}``: enforced by structured
  output (``text.tool_calls.forced_schema``); no parser flag needed.

``ToolPlan.pieces`` turns the text pieces of a generation into pieces that carry content and
``tool_calls`` (each call with its ``index``; streamed as soon as it is complete, a named call's
arguments as they are generated), and the finish reason becomes ``tool_calls`` when the reply
made calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from poise.core.structured import StructuredOutputsParams
from poise.errors import InvalidRequestError
from poise.text.tool_calls import (
    TOOL_PARSERS,
    HermesToolParser,
    ToolCall,
    forced_calls,
    forced_schema,
)

if TYPE_CHECKING:  # generation.py imports this module
    from poise.serving.generation import Piece

# apply_chat_template's own arguments (and poise's render_chat's ``tokenizer``): a
# chat_template_kwargs key may not replace them.
_RESERVED_KWARGS = (
    "tokenizer",
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: _FunctionName


class ChatTemplateFields(BaseModel):
    """Chat-only request fields: the template (vLLM's ``chat_template``,
    ``chat_template_kwargs``) and the tools."""

    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


def template_kwargs(req: ChatTemplateFields) -> dict[str, Any]:
    """Keywords for ``text.apply_chat_template``: the request's template, tools and
    ``chat_template_kwargs`` (a key that would replace one of its arguments is a 400)."""
    extra = checked_template_kwargs(req.chat_template_kwargs)
    return {"chat_template": req.chat_template, "tools": req.tool_dicts(), **extra}


def checked_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` (chat and /tokenize alike), refused with a 400
    when a key would replace one of apply_chat_template's own arguments."""
    extra = dict(kwargs or {})
    clash = sorted(set(extra) & set(_RESERVED_KWARGS))
    if clash:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {clash}: they are request fields or fixed",
            "chat_template_kwargs",
        )
    return extra


@dataclass
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    tools: list[dict[str, Any]]
    name: str | None = None  # the named function
    parser: str | None = None  # auto: the --tool-call-parser
    parallel: bool = True
    structured: StructuredOutputsParams | None = field(default=None)

    async def pieces(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
        """``pieces`` with the model's calls taken out of the text into ``tool_calls``. Closing
        this iterator closes ``pieces`` at once (which aborts the request if unfinished)."""
        if self.mode == "named":
            out = _named(pieces, self.name or "")
        elif self.mode == "required":
            out = _required(pieces)
        elif self.mode == "auto":
            out = _parsed(pieces, self.parser or "hermes")
        else:
            out = pieces
        try:
            async for piece in out:
                yield piece
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]


def plan_tools(req: ChatTemplateFields, auto_parser: str | None) -> ToolPlan | None:
    """The request's tool handling, or None without tools. ``auto_parser``: the server's
    ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on. 400s name the field."""
    tools = req.tool_dicts()
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    if choice is None or choice == "auto":
        if auto_parser is None:
            raise InvalidRequestError(
                '"auto" tool choice (the default with tools) needs the server started with '
                "--enable-auto-tool-choice and --tool-call-parser; or use tool_choice "
                '"required", "none" or a named function',
                "tool_choice",
            )
        return ToolPlan("auto", tools, parser=auto_parser, parallel=req.parallel_tool_calls)
    if choice == "none":
        return ToolPlan("none", tools)
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError(
            f"tool_choice names {name!r}, which is not in tools", "tool_choice"
        )
    schema = forced_schema(tools, name, req.parallel_tool_calls)
    structured = StructuredOutputsParams(json=schema, source_field="tool_choice")
    mode: Literal["required", "named"] = "named" if name is not None else "required"
    return ToolPlan(mode, tools, name=name, parallel=req.parallel_tool_calls, structured=structured)


def _finish(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


async def _named(pieces: AsyncIterator[Piece], name: str) -> AsyncIterator[Piece]:
    """The generated text is the arguments: one call per sample, its arguments streamed as
    they come."""
    ids: dict[int, str] = {}  # sample index -> its call's id, once its first delta is out
    async for p in pieces:
        delta: dict[str, Any] = {"index": 0, "function": {"arguments": p.text}}
        if p.index not in ids:
            call = ToolCall(name, p.text)
            ids[p.index] = call.id
            delta = call.to_openai(0)
        yield replace(p, text="", finish_reason=_finish(p.finish_reason, True), tool_calls=[delta])


async def _required(pieces: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    """A JSON array of calls per sample: read whole, then given as calls (as text if cut)."""
    texts: dict[int, list[str]] = {}
    async for p in pieces:
        texts.setdefault(p.index, []).append(p.text)
        if p.finish_reason is None:
            continue
        text = "".join(texts.pop(p.index))
        calls = forced_calls(text, None)
        if not calls:
            yield replace(p, text=text)
            continue
        deltas = [c.to_openai(i) for i, c in enumerate(calls)]
        yield replace(p, text="", finish_reason=_finish(p.finish_reason, True), tool_calls=deltas)


async def _parsed(pieces: AsyncIterator[Piece], parser_name: str) -> AsyncIterator[Piece]:
    """Each sample's text through its own parser (``--tool-call-parser``)."""
    parsers: dict[int, HermesToolParser] = {}
    async for p in pieces:
        parser = parsers.setdefault(p.index, TOOL_PARSERS[parser_name]())
        final = p.finish_reason is not None
        before = parser.num_calls
        content, calls = parser.feed(p.text, final=final)
        deltas = [c.to_openai(before + i) for i, c in enumerate(calls)]
        if content or deltas or final:
            reason = _finish(p.finish_reason, parser.num_calls > 0)
            yield replace(p, text=content, finish_reason=reason, tool_calls=deltas or None)


def merge_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's tool-call deltas (streamed by index) as whole OpenAI ``tool_calls``."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(
            d["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if "id" in d:
            call["id"] = d["id"]
        fn = d.get("function", {})
        if "name" in fn:
            call["function"]["name"] = fn["name"]
        call["function"]["arguments"] += fn.get("arguments", "")
    return [calls[i] for i in sorted(calls)]
