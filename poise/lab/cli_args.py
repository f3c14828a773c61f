"""Argument helpers shared by ``poise sweep`` and ``poise tune``: the lab workload flags and
list parsing. Wiring only; defaults are the CPU-scaled lab (see presets.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from poise.lab.bench_adapter import SEED_LONG_REPEAT, LabWorkload


def ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None


def floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}"
        ) from None


def add_workload_args(p: argparse.ArgumentParser, *, single: bool = False) -> None:
    """``single``: one cell (tune fixes the load); else lists (sweep's matrix)."""
    g = p.add_argument_group(
        "workload", "The seed lab's requests: short and long chat prompts, closed loop."
    )
    kind = "" if single else ", list"
    g.add_argument("--concurrency", type=ints, default=None,
                   help=f"Closed-loop client streams{kind}.")  # fmt: skip
    g.add_argument("--long-ratio", type=floats, default=None,
                   help=f"Fraction of long prompts{kind}.")  # fmt: skip
    g.add_argument("--max-tokens", type=int, default=None, help="Output tokens per request.")
    g.add_argument("--num-requests", type=int, default=None, help="Measured requests per cell.")
    g.add_argument("--warmup", type=int, default=None, help="Warmup requests per cell.")
    g.add_argument("--long-repeat", type=int, default=None,
                   help=f"Repeats of the seed's log line in the long prompt (seed: {SEED_LONG_REPEAT}).")  # fmt: skip
    g.add_argument("--workload-seed", type=int, default=None, help="Request sample seed.")
    g.add_argument("--request-timeout", type=float, default=None, help="Seconds per request.")


def workload_from_args(
    args: argparse.Namespace, base: LabWorkload, *, single: bool = False
) -> LabWorkload:
    """``base`` with the flags the user gave; ``single`` keeps only the first value of lists."""
    kw: dict[str, Any] = {}
    for name in ("concurrency", "long_ratio"):
        value = getattr(args, name, None)
        if value is not None:
            kw[name] = tuple(value[:1]) if single else tuple(value)
    for name, field in (("max_tokens", "max_tokens"), ("num_requests", "num_requests"),
                        ("warmup", "warmup"), ("long_repeat", "long_repeat"), ("workload_seed", "seed"),
                        ("request_timeout", "timeout_s")):  # fmt: skip
        value = getattr(args, name, None)
        if value is not None:
            kw[field] = value
    import dataclasses

    wl = dataclasses.replace(base, **kw)
    if single:
        wl = dataclasses.replace(wl, concurrency=wl.concurrency[:1], long_ratio=wl.long_ratio[:1])
    return wl


def default_out(prefix: str) -> Path:
    return Path(f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}")
