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

from pydantic import BaseModel, ConfigDict, Field, model_validator

from poise.core.structured import StructuredOutputsParams
from poise.errors import InvalidRequestError

_LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, strict=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """``structured_outputs`` as a request carries it: vLLM's ``StructuredOutputsParams``
    fields, typed, so that the published schema says what is taken (it said "any object", and
    the fuzzer's objects were refused). Exactly one constraint is a rule across fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_schema: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool = False

    @model_validator(mode="before")
    @classmethod
    def _no_structural_tag(cls, data: Any) -> Any:
        if isinstance(data, dict) and "structural_tag" in data:  # vLLM's; refused by name
            raise ValueError(
                "structural_tag is not supported by poise; use json, regex, choice or grammar"
            )
        return data

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams.of(self.model_dump(by_alias=True, exclude_unset=True))


class StructuredOutputFields(BaseModel):
    """The request fields, shared by chat and completions (``protocol._SamplingRequest``)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = Field(None, min_length=1)
    # At least one choice: the published schema says so (an empty list was schema-valid and
    # then refused by the grammar compiler).
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)
    guided_whitespace_pattern: str | None = None
    # What poise runs: vLLM's "guidance" is llguidance.
    guided_decoding_backend: Literal["auto", "guidance", "llguidance"] | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """What the request constrains its output to, or None. InvalidRequestError (400)
        naming the field when the fields conflict or are malformed."""
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
            found.append(self.structured_outputs.params())
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
