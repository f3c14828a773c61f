"""Engine knobs as argparse flags, generated from the config dataclasses' field metadata.

Every field of ModelConfig, CacheConfig and SchedulerConfig becomes one flag spelled like
vLLM's (``max_num_seqs`` -> ``--max-num-seqs``), in one argument group per dataclass, with the
field's ``metadata["help"]`` (what the knob trades) and its default. Aliases from
``poise.config.ALIASES`` become extra spellings of the same flag (``--max-num-queued-reqs``,
``--watermark``...). Other config dataclasses (``RequestLimitsConfig`` for ``poise serve``) get
their flags the same way through ``add_config_group`` / ``config_from_args``; fields named
``*_bytes`` accept sizes such as ``8MiB``.

Invariants:
- Flags default to None (``BooleanOptionalAction`` too), and ``engine_config_from_args`` passes
  only the flags the user gave to ``EngineConfig.from_kwargs``: the config dataclasses stay the
  single source of defaults.
- Nothing here validates values beyond their type; the config's ``__post_init__`` does, and
  its ``ValueError`` names the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any

from poise.config import (
    ADMISSION_CONTROLS,
    ALIASES,
    DTYPES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    normalize_policy,
)

T = typing.TypeVar("T")

# (title, description, dataclass): one argparse group each, in this order.
GROUPS: tuple[tuple[str, str, type], ...] = (
    ("model", "What to load and how.", ModelConfig),
    (
        "KV cache",
        "The KV-cache budget: how many tokens of context the engine can hold at once.",
        CacheConfig,
    ),
    (
        "scheduler",
        "The token budget per step, the request cap and the waiting queue: the TTFT / "
        "throughput trade-off of continuous batching.",
        SchedulerConfig,
    ),
)

_POLICY_NAMES = [p.replace("_", "-") for p in SCHEDULING_POLICIES]
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1073741824', '4GiB', '512MB', '1.5g' -> bytes (K/M/G/T: binary with 'i', else decimal,
    a bare letter counts as binary)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}")
    number, unit, binary = match.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    base = 1000 if (unit and not binary and text.strip().lower().endswith("b")) else 1024
    return int(float(number) * base**power)


def policy_choice(text: str) -> str:
    value = normalize_policy(text)
    if value not in SCHEDULING_POLICIES:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r} (choose from {', '.join(_POLICY_NAMES)})"
        )
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(hint: Any) -> Any:
    """``int | None`` -> int; plain types unchanged."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def _default_text(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return ""
    if value is None:
        return ""
    if isinstance(value, bool):
        return f" (default: {'on' if value else 'off'})"
    if field.name == "scheduling_policy":
        value = str(value).replace("_", "-")
    return f" (default: {value})"


def _aliases_of(name: str) -> list[str]:
    return [_flag(alias) for alias, target in ALIASES.items() if target == name]


def _kwargs_for(field: dataclasses.Field[Any], hint: Any) -> dict[str, Any]:
    """argparse keyword arguments for one config field."""
    help_text = field.metadata.get("help", "") + _default_text(field)
    kwargs: dict[str, Any] = {"dest": field.name, "default": None, "help": help_text}
    base = _base_type(hint)
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif field.name == "scheduling_policy":
        kwargs.update(type=policy_choice, metavar="{" + ",".join(_POLICY_NAMES) + "}")
    elif field.name == "admission_control":
        kwargs.update(choices=ADMISSION_CONTROLS)
    elif field.name == "dtype":
        kwargs.update(choices=DTYPES)
    elif field.name == "quantization":
        kwargs.update(choices=QUANTIZATIONS)
    elif field.name.endswith("_bytes") or field.name == "kv_cache_memory_base":
        kwargs.update(type=parse_bytes, metavar="BYTES")
    elif base in (int, float):
        kwargs.update(type=base, metavar=base.__name__.upper())
    else:
        kwargs.update(metavar="STR")
    return kwargs


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool = False) -> None:
    """Add one flag per engine knob, grouped like the config dataclasses.

    ``positional_model=True`` makes the model an optional positional (``poise serve [MODEL]``)
    and keeps ``--model`` as a second spelling; otherwise only ``--model`` exists.
    """
    for title, description, cls in GROUPS:
        group = parser.add_argument_group(title, description)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            kwargs = _kwargs_for(field, hints[field.name])
            if field.name == "model" and positional_model:
                group.add_argument(
                    "model", nargs="?", default=None, metavar="MODEL", help=kwargs["help"]
                )
                group.add_argument(
                    "--model", dest="model_flag", default=None, metavar="STR",
                    help="Same as MODEL.",
                )  # fmt: skip
                continue
            group.add_argument(_flag(field.name), *_aliases_of(field.name), **kwargs)


def add_config_group(
    parser: argparse.ArgumentParser, title: str, description: str, cls: type
) -> None:
    """One flag per field of the config dataclass ``cls``, in one argument group."""
    group = parser.add_argument_group(title, description)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        group.add_argument(
            _flag(field.name), *_aliases_of(field.name), **_kwargs_for(field, hints[field.name])
        )


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """``cls`` built from the flags the user gave (its own defaults for the others).

    Raises ValueError naming the field when a value is out of range.
    """
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if getattr(args, f.name, None) is not None
    }
    return cls(**given)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user gave, as flat ``EngineConfig.from_kwargs`` keywords."""
    out: dict[str, Any] = {}
    for _, _, cls in GROUPS:
        for field in dataclasses.fields(cls):
            value = getattr(args, field.name, None)
            if field.name == "model" and value is None:
                value = getattr(args, "model_flag", None)
            if value is not None:
                out[field.name] = value
    return out


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """Build the EngineConfig from parsed flags; ``overrides`` win over flags.

    Raises ValueError naming the field when a value is out of range.
    """
    kwargs = engine_kwargs_from_args(args)
    kwargs.update(overrides)
    return EngineConfig.from_kwargs(**kwargs)
