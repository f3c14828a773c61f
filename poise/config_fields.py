"""The two helpers every config dataclass is written with (poise/config.py, config_model.py,
serving/settings.py): a field carrying its CLI help text, and a check that names the field."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def _help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {message}")
