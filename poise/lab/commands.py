"""Server command lines: poise's own (``python -m poise serve MODEL --flag value``) and
templates for any other engine (``vllm serve M --port {port} --max-num-seqs {max_num_seqs}``).

Invariants: flags are spelled like the CLI generated from the config (``max_num_seqs`` ->
``--max-num-seqs``); booleans become ``--flag`` / ``--no-flag`` (argparse
BooleanOptionalAction); None values are left out. A template names its knobs as ``{field}``
placeholders; a placeholder without a value is an error naming it, never silently empty.
"""

from __future__ import annotations

import shlex
import string
import sys
from collections.abc import Mapping
from typing import Any


def args_to_flags(args: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in args.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            out += [flag, _text(key, value)]
    return out


def _text(key: str, value: Any) -> str:
    if key == "scheduling_policy":
        return str(value).replace("_", "-")
    return str(value)


def poise_serve_argv(
    model: str | None, args: Mapping[str, Any], port: int | None = None, python: str | None = None
) -> list[str]:
    """argv that starts poise; ``python=None`` gives the user-facing ``poise serve ...``."""
    head = [python, "-m", "poise", "serve"] if python else ["poise", "serve"]
    argv = head + ([model] if model else [])
    if port is not None:
        argv += ["--host", "127.0.0.1", "--port", str(port)]
    rest = {k: v for k, v in args.items() if k != "model"}
    return argv + args_to_flags(rest)


def poise_serve_command(model: str | None, args: Mapping[str, Any]) -> str:
    return shlex.join(poise_serve_argv(model, args))


def template_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def fill_template(template: str, values: Mapping[str, Any]) -> str:
    """Fill ``{name}`` placeholders; booleans as true/false, policy with dashes."""
    missing = [f for f in template_fields(template) if f not in values]
    if missing:
        raise ValueError(f"command template: no value for {{{missing[0]}}}")
    shown = {k: (str(v).lower() if isinstance(v, bool) else _text(k, v)) for k, v in values.items()}
    return template.format(**shown)


def python_executable() -> str:
    return sys.executable
