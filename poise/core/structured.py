"""Structured output requests (vLLM's ``StructuredOutputsParams``) and the grammar seam.

What a request asks for is plain data here; compiling it into a grammar and masking logits is
the job of ``text/grammar.py`` (llguidance) and ``runner/structured.py`` (the bitmask in the
batched sampler step). The engine only sees the two protocols below:

- ``GrammarCompiler.new_state(params)``: a fresh matcher for one request, from a cache of
  compiled grammars keyed by the spec; raises InvalidRequestError naming the field on an
  invalid schema, regex or grammar.
- ``GrammarState``: advanced with each accepted token (``accept_token``) by the stop rules
  (sched/stopping.py); ``is_terminated`` once the grammar is complete, which finishes the
  request with ``stop``.

Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` is set (vLLM's
rule). ``structural_tag`` is vLLM's too, but poise refuses it by name rather than ignore it.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any, Protocol

from poise.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's shape: ``StructuredOutputsParams(json=schema)`` (a dict or its JSON text),
    ``regex=``, ``choice=[...]``, ``grammar=`` (Lark or GBNF/EBNF text), ``json_object=True``.

    ``disable_any_whitespace``: poise's default (None) is compact JSON, no free whitespace
    between tokens. Why not vLLM's flexible default: a weak or random model, offered every
    whitespace token between JSON tokens, can spend its whole budget on whitespace and never
    close the object. ``False`` asks for flexible whitespace explicitly.

    ``disable_additional_properties``: None (the default) takes the server's rule, which is
    poise's (and vLLM's xgrammar's) closed objects: a ``json`` schema's objects hold only the
    properties they declare, at every level, unless they say otherwise
    (``text/json_schema.py``); ``--allow-additional-properties`` switches a server back to the
    JSON Schema default. ``True`` / ``False`` decide for this request whatever the server's rule.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # vLLM's: no fallback to another backend on error. poise has one backend and never falls
    # back, so both values mean the same here.
    disable_fallback: bool = False
    # The request field this came from, for error messages (HTTP: response_format, tool_choice,
    # structured_outputs, guided_json, ...).
    source_field: str = field(default="structured_outputs", compare=False)

    def kind(self) -> str:
        """The one kind of constraint set; InvalidRequestError when none or several are."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if self.structural_tag is not None:
            raise InvalidRequestError(
                "structural_tag is not supported by poise; use json, regex, choice or grammar",
                self.source_field,
            )
        if len(given) != 1:
            raise InvalidRequestError(
                f"exactly one of {', '.join(KINDS)} must be set, got {given or 'none'}",
                self.source_field,
            )
        return given[0]

    def spec(self) -> tuple[str, str]:
        """(kind, canonical text): the compiled-grammar cache key. Validates the field types."""
        kind = self.kind()
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = _json.loads(value)
                except ValueError as exc:
                    raise InvalidRequestError(
                        f"json schema is not valid JSON: {exc}", self.source_field
                    ) from exc
            if not isinstance(value, dict | bool):
                raise InvalidRequestError("json schema must be an object", self.source_field)
            return kind, _json.dumps(value)  # key order kept: it is the output order
        if kind == "choice":
            if not value or not all(isinstance(c, str) for c in value):
                raise InvalidRequestError(
                    "choice must be a non-empty list of strings", self.source_field
                )
            return kind, _json.dumps(list(value))
        if kind == "json_object":
            return kind, ""
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{kind} must be a non-empty string", self.source_field)
        return kind, value

    def options(self) -> tuple[bool, bool | None, str | None]:
        """(flexible whitespace, no additional properties (None: the server's rule), whitespace
        pattern): part of the key."""
        return (
            self.disable_any_whitespace is False,
            self.disable_additional_properties,
            self.whitespace_pattern,
        )

    @classmethod
    def of(cls, value: Any, source_field: str = "structured_outputs") -> StructuredOutputsParams:
        """From an instance or vLLM's dict form (``{"json": {...}}``); unknown keys are a 400."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(
                f"{source_field} must be an object or StructuredOutputsParams", source_field
            )
        names = set(cls.__dataclass_fields__) - {"source_field"}
        unknown = sorted(set(value) - names)
        if unknown:
            raise InvalidRequestError(
                f"{source_field}: unknown field(s) {unknown}; known: {sorted(names)}", source_field
            )
        return cls(**value, source_field=source_field)


# vLLM's earlier name for the same thing (``SamplingParams(guided_decoding=...)``).
GuidedDecodingParams = StructuredOutputsParams


class GrammarState(Protocol):
    """One request's matcher: where its output stands in the grammar."""

    def accept_token(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete: nothing but the end may follow."""
        ...

    def is_failed(self) -> bool:
        """The output can go no further in the grammar (found when the mask was computed)."""
        ...


class GrammarCompiler(Protocol):
    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for ``params`` (compiled once per spec, then cached)."""
        ...
