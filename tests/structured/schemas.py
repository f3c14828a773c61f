"""JSON schemas whose every valid instance is short (bounded strings, integers and arrays), so
a random model constrained by them always finishes inside a small token budget."""

from __future__ import annotations

from typing import Any

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
NUMBERS: dict[str, Any] = {
    "type": "array",
    "items": {"type": "integer", "minimum": -5, "maximum": 5},
    "minItems": 1,
    "maxItems": 4,
}
NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["ok", "tag", "point"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "numbers": NUMBERS, "nested": NESTED}
