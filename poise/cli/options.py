"""Engine knobs as flag records (poise.cli.flags), generated from the config dataclasses.

Every field of ModelConfig, CacheConfig and SchedulerConfig becomes one ``Flag`` spelled like
vLLM's (``max_num_seqs`` -> ``--max-num-seqs``), in one registry group per dataclass, with the
field's ``metadata["help"]`` (what the knob trades) and its default. Aliases from
``poise.config.ALIASES`` become extra spellings of the same flag (``--max-num-queued-reqs``,
``--watermark``...). Other config dataclasses (``RequestLimitsConfig`` for ``poise serve``) get
their flags the same way through ``config_flags`` / ``config_from_args``; fields named
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

from poise.cli.flags import Flag, add_flags
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

# (flag group, dataclass): the engine's flags, one group per config dataclass.
ENGINE_GROUPS: tuple[tuple[str, type], ...] = (
    ("model", ModelConfig),
    ("scheduler", SchedulerConfig),
    ("cache", CacheConfig),
)

# Engine options vLLM has too, with vLLM's spelling (the docs' vLLM column); the others are
# poise's own.
VLLM_SPELLINGS: dict[str, str] = {
    **{
        name: "--" + name.replace("_", "-")
        for name in (
            "model",
            "tokenizer",
            "dtype",
            "device",
            "seed",
            "generation_config",
            "max_model_len",
            "enforce_eager",
            "quantization",
            "max_num_seqs",
            "max_num_batched_tokens",
            "enable_chunked_prefill",
            "long_prefill_token_threshold",
            "scheduling_policy",
            "block_size",
            "gpu_memory_utilization",
            "kv_cache_memory_bytes",
            "enable_prefix_caching",
            "kv_cache_dtype",
        )
    },
    "num_kv_blocks": "--num-gpu-blocks-override",
}
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
        return "on" if value else "off"
    if field.name == "scheduling_policy":
        value = str(value).replace("_", "-")
    return str(value)


def _aliases_of(name: str) -> tuple[str, ...]:
    return tuple(_flag(alias) for alias, target in ALIASES.items() if target == name)


def _parse_kwargs(field: dataclasses.Field[Any], hint: Any) -> dict[str, Any]:
    """How one config field's value is parsed: type, choices, metavar or action."""
    base = _base_type(hint)
    if base is bool:
        return {"action": argparse.BooleanOptionalAction}
    if field.name == "scheduling_policy":
        return {"type": policy_choice, "metavar": "{" + ",".join(_POLICY_NAMES) + "}"}
    for name, choices in (
        ("admission_control", ADMISSION_CONTROLS),
        ("dtype", DTYPES),
        ("quantization", QUANTIZATIONS),
    ):
        if field.name == name:
            return {"choices": choices}
    if field.name.endswith("_bytes") or field.name == "kv_cache_memory_base":
        return {"type": parse_bytes, "metavar": "BYTES"}
    if base in (int, float):
        return {"type": base, "metavar": base.__name__.upper()}
    return {"metavar": "STR"}


def config_flags(cls: type, group: str) -> list[Flag]:
    """One flag per field of the config dataclass ``cls``: its help is the field's
    ``metadata["help"]``, its default note the field's default, and the flag itself defaults
    to None, so only what the user gave reaches the dataclass."""
    hints = typing.get_type_hints(cls)
    return [
        Flag(
            dest=field.name,
            group=group,
            help=field.metadata.get("help", ""),
            default_text=_default_text(field),
            aliases=_aliases_of(field.name),
            vllm=VLLM_SPELLINGS.get(field.name),
            **_parse_kwargs(field, hints[field.name]),
        )
        for field in dataclasses.fields(cls)
    ]


def engine_flags() -> list[Flag]:
    """The engine's flags, in ``ENGINE_GROUPS`` order."""
    return [flag for group, cls in ENGINE_GROUPS for flag in config_flags(cls, group)]


def model_positional(flags: list[Flag]) -> dict[str, Any]:
    """``poise serve [MODEL]``: the model as an optional positional, ``--model`` as a second
    spelling (its own dest, merged by ``engine_kwargs_from_args``)."""
    model = next(f for f in flags if f.dest == "model")
    flags.remove(model)

    def add(group: Any) -> None:
        help_text = model.argparse_kwargs()["help"]
        group.add_argument("model", nargs="?", default=None, metavar="MODEL", help=help_text)
        group.add_argument(
            "--model", dest="model_flag", default=None, metavar="STR", help="Same as MODEL."
        )

    return {model.group: add}


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool = False) -> None:
    """Add one flag per engine knob, grouped like the config dataclasses.

    ``positional_model=True`` makes the model an optional positional (``poise serve [MODEL]``)
    and keeps ``--model`` as a second spelling; otherwise only ``--model`` exists.
    """
    flags = engine_flags()
    first = model_positional(flags) if positional_model else None
    add_flags(parser, flags, first=first)


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
    for _, cls in ENGINE_GROUPS:
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
