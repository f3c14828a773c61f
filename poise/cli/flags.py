"""The flag registry's machinery: a ``Flag`` record per option, and what is generated from it.

Every option of ``poise serve`` is one ``Flag`` (poise/cli/serve_flags.py lists them; the
engine's come from the config dataclasses' fields, poise/cli/options.py). From the records:

- the argparse options, one argument group per ``GROUPS`` entry, in that order (vLLM's
  ``--help`` layout: model, scheduler, cache, server, ...);
- the ``ServerSettings`` keywords (``Flag.setting``) and the ``server_args`` that
  ``/server_info`` reports and ``poise bench`` records;
- the flag tables of docs/flags.md (``python -m poise.cli.serve_flags`` writes them; a test
  fails when the page and the registry disagree).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# (title, description): the argument groups, in --help order.
GROUPS: tuple[tuple[str, str], ...] = (
    ("model", "What to load and how."),
    (
        "scheduler",
        "The token budget per step, the request cap and the waiting queue: the TTFT / "
        "throughput trade-off of continuous batching.",
    ),
    ("cache", "The KV-cache budget: how many tokens of context the engine can hold at once."),
    ("server", "The HTTP front end: address, API surface, access and slow clients."),
    (
        "request limits",
        "What one HTTP request may ask of the server; beyond a limit the answer is a 4xx that "
        "names it.",
    ),
    ("observability", "Logs, metrics, traces and step traces."),
    (
        "scale-out",
        "N engine replicas behind poise's router (docs/scale-out.md: which policy when).",
    ),
)
GROUP_TITLES = tuple(title for title, _ in GROUPS)


@dataclass(frozen=True)
class Flag:
    """One command-line option, declared once.

    ``dest`` is the argparse destination (snake_case); the option is spelled ``--dest`` with
    dashes unless ``name`` says otherwise. ``vllm`` is vLLM's spelling of the same option when
    vLLM has one; ``aliases`` are the seed's and other engines' spellings, accepted too.
    ``setting`` names the ``ServerSettings`` field the value goes to (``convert`` maps it on
    the way). ``default_text`` replaces the generated "(default: ...)" note; ``secret`` values
    are reported as "set" in ``server_args``; ``replicas`` is False for an option the replicas
    do not take yet (given with ``--replicas N``, it is refused rather than ignored).
    """

    dest: str
    group: str
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: Sequence[str] | None = None
    nargs: str | None = None
    action: Any = None
    name: str | None = None
    vllm: str | None = None
    aliases: tuple[str, ...] = ()
    setting: str | None = None
    convert: Callable[[Any], Any] | None = None
    default_text: str | None = None
    secret: bool = False
    replicas: bool = True

    def __post_init__(self) -> None:
        if self.group not in GROUP_TITLES:
            raise ValueError(f"flag {self.dest}: unknown group {self.group!r}")

    @property
    def spelling(self) -> str:
        return self.name or "--" + self.dest.replace("_", "-")

    @property
    def spellings(self) -> list[str]:
        return [self.spelling, *self.aliases]

    def default_note(self) -> str:
        """The default as --help and the docs show it ("" when there is nothing to say)."""
        if self.default_text is not None:
            return self.default_text
        value = self.default
        if isinstance(value, bool) or self.action == "store_true":
            return "on" if value else "off"
        if value is None or value == []:
            return ""
        return str(value)

    def argparse_kwargs(self) -> dict[str, Any]:
        note = self.default_note()
        kwargs: dict[str, Any] = {
            "dest": self.dest,
            "default": self.default,
            "help": self.help + (f" (default: {note})" if note else ""),
        }
        for key in ("type", "metavar", "choices", "nargs", "action"):
            value = getattr(self, key)
            if value is not None:
                kwargs[key] = value
        return kwargs


def add_flags(
    parser: argparse.ArgumentParser,
    flags: Iterable[Flag],
    *,
    first: dict[str, Callable[[Any], None]] | None = None,
) -> None:
    """One argument group per ``GROUPS`` title that has flags, in ``GROUPS`` order.

    ``first[title](group)`` adds options of its own to that group before its flags (the
    engine's positional MODEL).
    """
    flags = list(flags)
    first = first or {}
    for title, description in GROUPS:
        mine = [f for f in flags if f.group == title]
        if not mine and title not in first:
            continue
        group = parser.add_argument_group(title, description)
        if title in first:
            first[title](group)
        for flag in mine:
            group.add_argument(*flag.spellings, **flag.argparse_kwargs())


def settings_kwargs(flags: Iterable[Flag], args: argparse.Namespace) -> dict[str, Any]:
    """``ServerSettings`` keywords from the parsed flags that name a setting."""
    out: dict[str, Any] = {}
    for flag in flags:
        if flag.setting is None:
            continue
        value = getattr(args, flag.dest)
        out[flag.setting] = flag.convert(value) if flag.convert is not None else value
    return out


def server_args(flags: Iterable[Flag], args: argparse.Namespace) -> dict[str, Any]:
    """Every option as given or defaulted, by dest: what ``/server_info`` reports."""
    out: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        out[flag.dest] = ("set" if value else None) if flag.secret else value
    return out


def refused_with_replicas(flags: Iterable[Flag], args: argparse.Namespace) -> list[str]:
    """The options in effect (given, or from the environment: ``convert``) that ``--replicas
    N`` does not take yet."""
    refused = []
    for flag in flags:
        if flag.replicas:
            continue
        value = getattr(args, flag.dest)
        if flag.convert is not None:
            value = flag.convert(value)
        if value not in (flag.default, []):
            refused.append(flag.spelling)
    return refused


def markdown_table(flags: Iterable[Flag]) -> str:
    """One docs table: flag (and other spellings), default, vLLM's spelling, what it does."""
    rows = ["| flag | default | vLLM | what it does |", "|---|---|---|---|"]
    for flag in flags:
        names = ", ".join(f"`{s}`" for s in flag.spellings)
        vllm = f"`{flag.vllm}`" if flag.vllm else ""
        text = " ".join(flag.help.split()).replace("|", "\\|")
        rows.append(f"| {names} | {flag.default_note() or '-'} | {vllm} | {text} |")
    return "\n".join(rows)


def _number(text: str, kind: type, ok: Callable[[Any], bool], what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive(text: str) -> float:
    return float(_number(text, float, lambda v: v > 0, "> 0"))


def non_negative(text: str) -> float:
    return float(_number(text, float, lambda v: v >= 0, ">= 0"))


def positive_int(text: str) -> int:
    return int(_number(text, int, lambda v: v > 0, "a whole number > 0"))
