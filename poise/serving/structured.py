"""The structured-output request fields, in the spellings OpenAI and vLLM users type.

- OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (``"text"``: unconstrained).
- vLLM (current): ``structured_outputs: {"json" | "regex" | "choice" | "grammar" |
  "json_object": ..., "disable_any_whitespace": ..., ...}``.
- vLLM (before 0.12, still in many clients): ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``, ``guided_whitespace_pattern``; and
  ``guided_decoding_backend``, which only accepts what poise is (``auto``, ``guidance``).

At most one of the ways may be used in a request. Each becomes a
``core.structured.StructuredOutputsParams`` whose ``source_field`` is the field the client
wrote, so a schema that does not compile answers 400 naming that field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from poise.core.structured import StructuredOutputsParams
from poise.errors import InvalidRequestError

_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}  # fmt: skip
# guided_decoding_backend values that name what poise runs (vLLM's "guidance" is llguidance).
_BACKENDS = ("auto", "guidance", "llguidance")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputFields(BaseModel):
    """The request fields, shared by chat and completions (``protocol._SamplingRequest``)."""

    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """What the request constrains its output to, or None. InvalidRequestError (400)
        naming the field when the fields conflict or are malformed."""
        backend = self.guided_decoding_backend
        if backend is not None and backend not in _BACKENDS:
            raise InvalidRequestError(
                f"guided_decoding_backend {backend!r}: poise compiles grammars with llguidance "
                f"only ({', '.join(_BACKENDS)})",
                "guided_decoding_backend",
            )
        found: list[StructuredOutputsParams] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutputsParams(json_object=True, source_field="response_format"))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.json_schema if rf.json_schema is not None else None
            # OpenAI's schema is optional; without one, any JSON object.
            found.append(
                StructuredOutputsParams(json=schema, source_field="response_format")
                if schema is not None
                else StructuredOutputsParams(json_object=True, source_field="response_format")
            )
        if self.structured_outputs is not None:
            found.append(StructuredOutputsParams.of(self.structured_outputs))
        for name, kind in _LEGACY.items():
            value = getattr(self, name)
            if value is not None:
                found.append(StructuredOutputsParams(**{kind: value}, source_field=name))
        if len(found) > 1:
            names = [p.source_field for p in found]
            raise InvalidRequestError(
                f"give one structured output constraint, got {names}", names[1]
            )
        if not found:
            if self.guided_whitespace_pattern is not None:
                raise InvalidRequestError(
                    "guided_whitespace_pattern needs guided_json", "guided_whitespace_pattern"
                )
            return None
        params = found[0]
        if self.guided_whitespace_pattern is not None:
            params.whitespace_pattern = self.guided_whitespace_pattern
        params.spec()  # field types, before any tokenizer work
        return params
