"""The lab's shared flags, one vocabulary for `poise bench`, `simulate`, `sweep` and `tune`.

- workload: one flag per ``WorkloadSpec`` field, generated from the field's metadata (help,
  spelling, parser) as ``cli/options.py`` generates the engine's flags from ``poise/config.py``:
  ``--concurrency --request-rate --burstiness --long-ratio --long-repeat --max-tokens --class
  --jsonl --num-requests --duration --warmup --workload-seed --request-timeout --salt
  --salt-scope --ignore-eos/--no-ignore-eos --temperature``;
- SLOs: ``--slo-ttft-p95-ms MS[,CLASS=MS...]`` and ``--slo-tpot-p50-ms MS[,CLASS=MS...]``: the
  tail a config must keep (TTFT p95, TPOT p50), which is also the per-request target goodput
  counts against;
- output: ``-o/--out PATH`` (a record's YAML path or a folder), ``--label``, ``--plots``.

Old spellings (bench's ``--seed``, ``--timeout``, ``--output``, ``--slo-ttft-ms``,
``--slo-tpot-ms``; simulate's ``--plot``; sweep's and tune's ``--threads``) keep working for one
release through ``deprecate``, which says so on stderr.

Invariants: workload flags default to None and ``workload_from_args`` applies only the flags
given over a command's base spec (a preset's CPU-scaled workload keeps what the user did not
say); the dataclass stays the single source of defaults and of validation.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from poise.bench.bench_config import WorkloadSpec, parse_class

PREFIX = "wl_"  # workload dests: WorkloadSpec.seed must not collide with the engine's --seed


def _flag(field: dataclasses.Field[Any]) -> str:
    return str(field.metadata.get("flag") or "--" + field.name.replace("_", "-"))


def _help(field: dataclasses.Field[Any]) -> str:
    text, value = str(field.metadata["help"]), field.default
    if "(default" in text or value in (None, (), dataclasses.MISSING):
        return text
    if isinstance(value, bool):
        value = "on" if value else "off"
    elif isinstance(value, tuple):
        value = ",".join(f"{x:g}" for x in value)
    return f"{text} (default: {value})"


def _argtype(parse: Any) -> Any:
    """``parse`` for argparse: its ValueError becomes the message argparse prints."""

    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc or 'invalid value'}: {text!r}") from None

    wrapped.__name__ = parse.__name__
    return wrapped


def _kwargs_for(field: dataclasses.Field[Any], hint: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dest": PREFIX + field.name, "default": None, "help": _help(field)}
    meta = field.metadata
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif field.name == "classes":
        kwargs.update(action="append", metavar=meta["metavar"])  # parsed once max_tokens is known
    else:
        origin = typing.get_args(hint)[0] if typing.get_origin(hint) is not None else hint
        kwargs["type"] = (
            _argtype(meta["type"])
            if "type" in meta
            else (origin if origin in (int, float) else str)
        )
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        else:
            kwargs["metavar"] = (
                meta.get("metavar") or getattr(kwargs["type"], "__name__", "STR").upper()
            )
    return kwargs


def add_workload_args(
    parser: argparse.ArgumentParser, *, title: str = "workload", description: str | None = None
) -> None:
    """One flag per WorkloadSpec field, in one argument group."""
    group = parser.add_argument_group(
        title,
        description
        or "The traffic: load points (concurrency x request rate x long ratio, one "
        "cell each), the request mix (the seed's SHORT/LONG prompts, --class or --jsonl), and "
        "the client's settings.",
    )
    hints = typing.get_type_hints(WorkloadSpec)
    for field in dataclasses.fields(WorkloadSpec):
        group.add_argument(_flag(field), **_kwargs_for(field, hints[field.name]))


def given_workload(args: argparse.Namespace) -> dict[str, Any]:
    """The workload flags the user gave, by WorkloadSpec field name (classes still raw)."""
    out = {}
    for field in dataclasses.fields(WorkloadSpec):
        value = getattr(args, PREFIX + field.name, None)
        if value is not None:
            out[field.name] = value
    return out


def workload_from_args(
    args: argparse.Namespace, base: WorkloadSpec | None = None, *, single: bool = False
) -> WorkloadSpec:
    """``base`` (default: WorkloadSpec()) with the flags the user gave. ``single`` keeps one
    cell: the first value of each axis (tune fixes the load).

    An open-loop ``--request-rate`` without ``--concurrency`` has no cap on requests in flight:
    the base's concurrency is a closed-loop setting and is not carried over as a cap.
    Raises ValueError for a bad ``--class`` or an out-of-range value.
    """
    base = base or WorkloadSpec()
    kw = given_workload(args)
    if "classes" in kw:
        max_tokens = kw.get("max_tokens", base.max_tokens)
        kw["classes"] = tuple(parse_class(c, max_tokens) for c in kw["classes"])
    if kw.get("salt") in ("none", ""):
        kw["salt"] = None
    rates = kw.get("request_rate", ())
    if rates and "concurrency" not in kw and not any(math.isinf(r) for r in rates):
        kw["concurrency"] = ()
    if "classes" in kw or "jsonl" in kw:  # the user's mix replaces the base's
        kw.setdefault("classes", ())
        kw.setdefault("jsonl", None)
    spec = dataclasses.replace(base, **kw)
    if single:
        axes = {
            f.name: getattr(spec, f.name)[:1]
            for f in dataclasses.fields(WorkloadSpec)
            if f.metadata.get("axis")
        }
        spec = dataclasses.replace(spec, **axes)
    return spec


# ---- SLOs -----------------------------------------------------------------------------------
SloArg = tuple[float | None, dict[str, float]]


def slo_arg(text: str) -> SloArg:
    """``500`` | ``500,long=5000`` | ``short=300``: (default, per-class overrides)."""
    default, per_class = None, {}
    try:
        for item in (x.strip() for x in text.split(",") if x.strip()):
            name, eq, value = item.partition("=")
            if eq:
                per_class[name.strip()] = float(value)
            else:
                default = float(item)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not MS[,CLASS=MS...]: {text!r}") from None
    return default, per_class


def add_slo_args(
    parser: argparse.ArgumentParser,
    *,
    required: bool = False,
    per_class: bool = True,
    tpot: bool = True,
) -> None:
    """``--slo-ttft-p95-ms`` (and ``--slo-tpot-p50-ms`` unless ``tpot`` is False, for a
    command that has no use for it); ``per_class=False``: one number (see ``single_slos``)."""
    group = parser.add_argument_group(
        "SLO",
        "Latency targets: a config meets them when its TTFT p95 and TPOT p50 are within "
        "them; goodput counts the requests that meet both.",
    )
    shape = "MS[,CLASS=MS...]" if per_class else "MS"
    per = ", optionally per class: 500 or 500,long=5000" if per_class else ""
    group.add_argument(
        "--slo-ttft-p95-ms",
        dest="slo_ttft",
        type=slo_arg,
        metavar=shape,
        required=required,
        default=(None, {}),
        help=f"TTFT p95 target{per}.",
    )
    if tpot:
        group.add_argument(
            "--slo-tpot-p50-ms",
            dest="slo_tpot",
            type=slo_arg,
            metavar=shape,
            default=(None, {}),
            help=f"TPOT p50 target{per}.",
        )
    else:
        parser.set_defaults(slo_tpot=(None, {}))


def slo_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The BenchConfig SLO fields from the SLO flags."""
    (ttft, ttft_class), (tpot, tpot_class) = args.slo_ttft, args.slo_tpot
    return {
        "slo_ttft_ms": ttft,
        "slo_tpot_ms": tpot,
        "class_slo_ttft_ms": ttft_class,
        "class_slo_tpot_ms": tpot_class,
    }


def single_slos(args: argparse.Namespace) -> tuple[float | None, float | None]:
    """(TTFT p95, TPOT p50) for commands that judge a whole cell; per-class targets there would
    be ignored, so they are refused."""
    for flag, (_, per_class) in (
        ("--slo-ttft-p95-ms", args.slo_ttft),
        ("--slo-tpot-p50-ms", args.slo_tpot),
    ):
        if per_class:
            raise ValueError(
                f"{flag}: per-class targets apply to `poise bench` / `simulate` "
                "goodput only; give one number here"
            )
    return args.slo_ttft[0], args.slo_tpot[0]


# ---- output ---------------------------------------------------------------------------------
def add_output_args(
    parser: argparse.ArgumentParser, what: str, *, label: bool = False, plots: bool | None = None
) -> None:
    """``-o/--out`` (what it names differs: ``what``), and ``--label`` / ``--plots`` where the
    command has them (``plots``: their default)."""
    group = parser.add_argument_group("output")
    group.add_argument("-o", "--out", default=None, metavar="PATH", help=what)
    if label:
        group.add_argument("--label", help="A name for this run (legends).")
    if plots is not None:
        group.add_argument(
            "--plots",
            action=argparse.BooleanOptionalAction,
            default=plots,
            help="Plots and an HTML report beside the results.",
        )


def default_out(prefix: str) -> Path:
    return Path(f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}")


def record_path(out: str | None, folder: str) -> Path:
    """``-o`` for a record: a ``.yaml``/``.yml`` path as given, else a folder (default
    ``folder``) holding ``<time>.yaml``."""
    if out and Path(out).suffix in (".yaml", ".yml"):
        return Path(out)
    return Path(out or folder) / f"{time.strftime('%Y%m%d-%H%M%S')}.yaml"


# ---- the lab's presets, scaled to the machine -----------------------------------------------
def add_preset_size_args(group: Any, *, scale_help: str, kv_help: str) -> None:
    """``--scale`` and ``--kv-base``: how far the lab's presets are scaled down
    (poise.lab.presets); the help says which defaults apply to the command."""
    group.add_argument("--scale", type=int, default=None, help=scale_help)
    group.add_argument("--kv-base", default=None, metavar="BYTES", help=kv_help)


def kv_base_bytes(args: argparse.Namespace) -> int:
    """``--kv-base`` in bytes: the KV budget at memory fraction 1.0 that presets scale."""
    from poise.cli.options import parse_bytes
    from poise.lab.presets import DEFAULT_KV_BASE_BYTES  # lazy: --help stays light

    return parse_bytes(args.kv_base) if args.kv_base else DEFAULT_KV_BASE_BYTES


# ---- started servers ------------------------------------------------------------------------
def add_server_args(parser: argparse.ArgumentParser) -> Any:
    """Flags for the servers a command starts (sweep, tune); returns the group for more."""
    group = parser.add_argument_group("servers", "How started servers run.")
    group.add_argument(
        "--omp-num-threads",
        type=int,
        default=None,
        metavar="N",
        help="OMP_NUM_THREADS for started servers (any engine; poise's own "
        "torch threads are the engine flag --num-threads).",
    )
    return group


def server_env(args: argparse.Namespace) -> dict[str, str]:
    threads = args.omp_num_threads
    return {"OMP_NUM_THREADS": str(threads)} if threads else {}


# ---- old spellings --------------------------------------------------------------------------
class _DeprecatedAlias(argparse.Action):
    """An old spelling: does what the new flag does, after a line on stderr."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, target: argparse.Action, new: str
    ) -> None:
        parse = target.type if callable(target.type) else None  # flags here never name a type
        super().__init__(
            option_strings,
            dest,
            nargs=target.nargs,
            type=parse,
            choices=target.choices,
            metavar=target.metavar,
            help=argparse.SUPPRESS,
        )
        self.target, self.new = target, new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: {option_string} is deprecated, use {self.new} (the old spelling "
            "goes in the next release)",
            file=sys.stderr,
        )
        self.target(parser, namespace, values, self.new)


def deprecate(parser: argparse.ArgumentParser, **renames: str) -> None:
    """Keep old spellings working: ``deprecate(p, timeout="--request-timeout")`` makes
    ``--timeout`` an alias of ``--request-timeout`` (hidden from --help)."""
    for old, new in renames.items():
        target = parser._option_string_actions[new]  # argparse keeps no public lookup
        parser.add_argument(
            "--" + old.replace("_", "-"),
            dest=target.dest,
            action=_DeprecatedAlias,
            target=target,
            new=new,
        )
