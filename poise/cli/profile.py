"""`poise profile [MODEL] [engine flags]`: measure the real runner's step time on this machine
over a grid of batch shapes, fit the simulator's linear step-cost model, save it as JSON.

Wiring only: measuring is in poise/runner/profiling.py (torch, imported lazily) and
poise/engine/overhead.py, fitting and the file format in poise/sim/fit.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from poise.cli.options import add_engine_args, engine_config_from_args

logger = logging.getLogger(__name__)


HELP = "Measure this machine's step times and fit the simulator's cost model."
DESCRIPTION = """
Drives the real model runner with hand-built batches over a grid of (prefill tokens, decode
batch size, context length), fits step time = c0 + c1*tokens + c2*seqs + c3*sampled + c4*prefill
attention pairs + c5*decode context tokens + c6*decode requests x longest decode context by
least squares, and writes the coefficients with their provenance (JSON). `poise simulate
--profile FILE` uses it.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        help="Profile path (default: profiles/<model>-<device>.json).",
    )
    parser.add_argument(
        "--grid", choices=("quick", "standard"), default="standard", help="Grid size."
    )
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs per grid point.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed runs per grid point.")
    parser.add_argument(
        "--threads",
        dest="num_threads",
        type=int,
        default=None,
        help="Same as the engine flag --num-threads: torch threads (default: torch's choice).",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time (a machine of your own). cpu: the thread's CPU time, immune "
        "to other load on a shared machine; needs --threads 1, and `poise simulate "
        "--time-scale` for the share of a core the server gets.",
    )
    parser.add_argument(
        "--no-engine-overhead",
        action="store_true",
        help="Skip measuring the engine's per-step overhead outside the runner.",
    )
    parser.add_argument(
        "--refit",
        metavar="PROFILE",
        default=None,
        help="Fit a profile's stored samples again (no measuring) and write it to -o "
        "(default: in place).",
    )
    parser.add_argument(
        "--merge",
        metavar="PROFILE",
        nargs="+",
        default=None,
        help="Merge profiles of the same grid measured at different times (median time per "
        "shape, then refit) and write the result to -o: a profile of the whole window.",
    )
    add_engine_args(parser, positional_model=True)


def refit(path: str, output: str | None) -> int:
    import json

    from poise.sim.cost import StepShape
    from poise.sim.fit import fit_with_knee, save_profile

    record = json.loads(Path(path).read_text())
    samples = [(StepShape.from_dict(d), float(d["time_s"])) for d in record["samples"]]
    coefficients, quality, knee = fit_with_knee(samples)
    record.update(
        coefficients=coefficients,
        features=list(coefficients),
        fit=quality.to_dict(),
        decode_padded_knee=knee,
    )
    record.setdefault("provenance", {})["refit"] = dt.datetime.now(dt.timezone.utc).isoformat(
        timespec="seconds"
    )
    out = save_profile(record, output or path)
    _print_summary(coefficients, quality.to_dict(), float(record.get("step_overhead_s", 0.0)))
    print(f"  decode_padded knee: {knee if knee is not None else 'none'}")
    print(f"profile: {out}")
    return 0


def _provenance(args: argparse.Namespace, info: Any, grid: str, threads: int) -> dict[str, Any]:
    import torch

    return {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["poise", *sys.argv[1:]]),
        "host": platform.node(),
        "machine": platform.machine(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": info.device,
        "dtype": info.dtype,
        "quantization": info.quantization,
        "model": info.model_name,
        "block_size": info.block_size,
        "num_kv_blocks": info.num_kv_blocks,
        "grid": grid,
        "repeats": args.repeats,
        "clock": args.clock,
    }


def merge(paths: list[str], output: str | None) -> int:
    import json

    from poise.sim.fit import merge_profiles, save_profile

    if not output:
        print("poise profile: error: --merge needs -o OUTPUT", file=sys.stderr)
        return 2
    try:
        record = merge_profiles([json.loads(Path(p).read_text()) for p in paths])
    except (OSError, ValueError) as exc:
        print(f"poise profile: error: {exc}", file=sys.stderr)
        return 2
    out = save_profile(record, output)
    _print_summary(record["coefficients"], record["fit"], float(record["step_overhead_s"]))
    print(f"profile: {out} (merged from {len(paths)})")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.refit:
        return refit(args.refit, args.output)
    if args.merge:
        return merge(args.merge, args.output)
    import torch

    from poise.engine.overhead import measure_engine_overhead
    from poise.runner.factory import create_model_runner
    from poise.runner.profiling import CLOCKS, build_grid, measure_grid
    from poise.sim.cost import StepShape
    from poise.sim.fit import fit_with_knee, profile_record, save_profile

    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"poise profile: error: {exc}", file=sys.stderr)
        return 2
    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        print("poise profile: error: --clock cpu needs --threads 1", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    runner, info = create_model_runner(config)
    print(
        f"profiling {info.model_name} on {info.device} ({info.dtype}, "
        f"{torch.get_num_threads()} threads), {info.num_kv_blocks} KV blocks",
        file=sys.stderr,
    )
    points = build_grid(
        args.grid,
        max_tokens=config.scheduler.max_num_batched_tokens,
        max_seqs=config.scheduler.max_num_seqs,
        capacity_tokens=info.num_kv_blocks * info.block_size,
        max_len=info.max_model_len,
    )

    def progress(i: int, n: int, p: Any, t: float) -> None:
        print(
            f"  [{i:>3}/{n}] prefill {p.chunks:>2} x {p.prefill:>5} @ {p.prefill_start:>5}"
            f"  decode {p.batch:>3} x ctx {p.context:>5}{' shared' if p.shared else ''}:"
            f" {t * 1000:9.2f} ms",
            file=sys.stderr,
        )

    measured = measure_grid(
        runner.execute,
        points,
        block_size=info.block_size,
        num_blocks=info.num_kv_blocks,
        warmup=args.warmup,
        repeats=args.repeats,
        clock=args.clock,
        progress=progress,
    )
    samples = [(StepShape.from_output(out), t) for out, t in measured]
    coefficients, quality, knee = fit_with_knee(samples)
    overhead = (
        0.0
        if args.no_engine_overhead
        else measure_engine_overhead(config, runner, info, tick=CLOCKS[args.clock])
    )
    kv_per_token = _kv_bytes_per_token(runner, info)
    record = profile_record(
        model=info.model_name,
        coefficients=coefficients,
        fit=quality,
        samples=samples,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        kv_bytes_per_token=kv_per_token,
        kv_int8_bytes_per_token=_kv_int8_bytes_per_token(runner),
        eos_token_ids=sorted(info.eos_token_ids),
        kv_budget_bytes=_default_kv_budget(info, kv_per_token),
        provenance=_provenance(args, info, args.grid, torch.get_num_threads()),
        decode_padded_knee=knee,
    )
    record["step_overhead_s"] = overhead
    record["provenance"]["wall_s"] = round(time.monotonic() - t0, 1)
    name = Path(str(info.model_name)).stem.replace(" ", "_")
    out = Path(args.output or f"profiles/{name}-{info.device.replace(':', '')}.json")
    save_profile(record, out)
    _print_summary(coefficients, quality.to_dict(), overhead)
    print(f"  decode_padded knee: {knee if knee is not None else 'none'}")
    print(f"profile: {out}")
    return 0


def _default_kv_budget(info: Any, kv_per_token: int) -> int:
    """The KV byte budget the runner uses when a config names none: on CPU the default base that
    gpu_memory_utilization takes its fraction of, on a GPU what this run's memory rule gave."""
    from poise.config import DEFAULT_KV_CACHE_MEMORY_BASE

    if str(info.device).startswith("cpu"):
        return DEFAULT_KV_CACHE_MEMORY_BASE
    return int(info.num_kv_blocks * info.block_size * kv_per_token)


def _kv_int8_bytes_per_token(runner: Any) -> int:
    """What one token would take in an int8 pool (the simulator's capacity for
    --kv-cache-dtype int8), from the shape of this run's per-layer caches."""
    from poise.config import INT8_SCALE_BYTES, kv_bytes_per_token
    from poise.model.attention.kv_int8 import is_int8_cache

    first = runner.kv_caches[0]
    head_dim = int(first.shape[-1]) - (INT8_SCALE_BYTES if is_int8_cache(first) else 0)
    num_kv_heads = int(first.shape[2]) // 2
    return kv_bytes_per_token(len(runner.kv_caches), num_kv_heads, head_dim, "int8", 1)


def _kv_bytes_per_token(runner: Any, info: Any) -> int:
    """K+V bytes of one token over all layers, read off the allocated pool (whatever its
    layout: per-layer (k, v) pairs or one tensor per layer)."""
    import torch

    def nbytes(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return int(x.numel() * x.element_size())
        return sum(nbytes(y) for y in x)

    return nbytes(runner.kv_caches) // (info.num_kv_blocks * info.block_size)


def _print_summary(coef: dict[str, float], fit: dict[str, float], overhead: float) -> None:
    units = {
        "const": "ms/step",
        "tokens": "ms/token",
        "seqs": "ms/request",
        "sampled": "ms/sampled",
        "prefill_attn": "ms/1k pairs",
        "decode_ctx": "ms/1k ctx",
        "decode_unique_ctx": "ms/1k unique ctx",
        "decode_padded": "ms/1k padded ctx",
        "decode_padded_excess": "ms/1k past knee",
        "prefill_chunks": "ms/chunk",
    }
    for name, value in coef.items():
        per_k = (
            "prefill_attn",
            "decode_ctx",
            "decode_unique_ctx",
            "decode_padded",
            "decode_padded_excess",
        )
        scale = 1e6 if name in per_k else 1e3
        print(f"  {name:<13} {value * scale:10.4f} {units[name]}")
    print(f"  engine overhead {overhead * 1e3:.3f} ms/step (outside the runner)")
    print(
        f"  fit: n={fit['n']}  MAPE {fit['mape'] * 100:.1f}%  max error "
        f"{fit['max_rel_error'] * 100:.1f}%  R^2 {fit['r2']:.4f}"
    )
    logger.debug("fit %s", fit)
