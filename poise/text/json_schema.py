"""Closing JSON schemas: what a schema does not declare, the output may not hold.

JSON Schema's default is that an object may carry properties its schema does not name. For a
sampler that default is a trap: offered "another property" at every comma, a model (the
embedded SmolLM2 with a forced tool call, in issue 38) keeps inventing keys until
``max_tokens`` and the reply is cut JSON. vLLM's default backend (xgrammar) accepts only the
declared properties at every level unless the schema allows more; poise does the same for
``json_schema`` response formats, ``structured_outputs.json`` and tool parameters, with one
switch back (``--allow-additional-properties``, or a request's
``structured_outputs.disable_additional_properties: false``).

``close_objects(schema)`` returns a copy in which every object schema (``"type": "object"``,
or ``properties`` without a type) that does not say ``additionalProperties`` gets ``false``;
one that says ``true`` or gives a schema keeps it, and the walk goes on inside it. The members
of an ``allOf`` (and a schema holding one) are left as they are: ``additionalProperties`` sees
only its own schema's ``properties``, so closing each member would forbid the others'
properties and make the intersection unsatisfiable.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if isinstance(kind, list):
        return "object" in kind
    return kind == "object" or (kind is None and "properties" in schema)


def close_objects(schema: Any) -> Any:
    """``schema`` with every object that does not say ``additionalProperties`` closed."""
    if not isinstance(schema, dict):
        return schema  # true/false schemas, or a malformed value the compiler will refuse
    out: dict[str, Any] = dict(schema)
    for key in _ONE:
        if key in out:
            value = out[key]
            out[key] = (
                [close_objects(s) for s in value]
                if isinstance(value, list)
                else (close_objects(value))
            )
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = close_objects(out["additionalProperties"])
    if isinstance(out.get("allOf"), list):
        # The members keep their own openness; what they nest is closed.
        out["allOf"] = [_close_inside(s) for s in out["allOf"]]
        return out
    if _is_object(out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _close_inside(schema: Any) -> Any:
    """An ``allOf`` member: closed below its top level, its own top level left open."""
    if not isinstance(schema, dict):
        return schema
    closed = close_objects(schema)
    if "additionalProperties" not in schema and isinstance(closed, dict):
        closed.pop("additionalProperties", None)
    return closed
