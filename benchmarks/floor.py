"""Decode and prefill of real model sizes against the hardware floor, measured in the same run.

1. The floors (hardware.py): DRAM read bandwidth (a streaming-read kernel over
   ``--bandwidth-gib``), the bf16 and int8 GEMM peaks (``--gemm-size``).
2. Per model and ``--quantization``: all of its linear layers as the model runs them
   (linear_times.py), weights resident in DRAM, one pass over every layer as a decode step
   makes (the best of ``--repeats`` passes, in two rounds apart); at each ``--batches`` row
   count, as a ratio to bytes read / DRAM bandwidth; and at
   ``--prefill-rows`` rows over the first ``--prefill-layers`` layers (compute-bound: a few
   layers give the ratio), as a ratio to FLOPs / bf16 peak and / int8 peak (the floor with
   int8 activations).
3. Per model, format and batch: a decode step through the real ``ModelRunner.execute``
   split into linears, attention, norms/rope/activation, lm_head, sampling, input building
   and host time between the timed parts (step_breakdown.py), and the step as a ratio to
   the weight-read floor (the TPOT floor).

Models: ``--shapes`` picks among benchmarks/shapes/ (random ``dummy:`` weights of real
models' shapes: SmolLM2-1.7B, Llama-3.2-1B, Qwen2.5-1.5B); ``--model dummy:DIR`` (or any
model path) replaces them. Every model is loaded in bfloat16, then quantized per format.

    .venv/bin/python benchmarks/floor.py [--shapes a,b] [--quantization bf16,int8,int4]
        [--batches 1,4,16] [--json PATH] [--tiny]

``--tiny`` shrinks every size (buffers, GEMMs, repeats) for a smoke run on a tiny model:
the figures then mean nothing. Timings are best-of-repeats (linears) or medians (steps) in
wall time: run it on an idle machine. Every figure goes to ``--json`` (seconds, bytes,
FLOPs, and each ratio beside its figure as ``x_floor`` / ``x_bf16_floor`` / ``x_int8_floor``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# As poise.runner does for the CLI: OpenMP reads this once, when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from engine_steps import DecodeBatch, projections  # noqa: E402
from hardware import GIB, measure_floors  # noqa: E402
from linear_times import (  # noqa: E402
    bytes_by_kind,
    decode_linears,
    flops_by_kind,
    prefill_layers,
    prefill_linears,
)
from report import add_ratios, print_model  # noqa: E402
from step_breakdown import breakdown, steps_needed  # noqa: E402

from poise.config import EngineConfig  # noqa: E402
from poise.runner.factory import create_model_runner  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES_DIR = Path(__file__).resolve().parent / "shapes"
SHAPES = ("smollm2-1.7b", "llama-3.2-1b", "qwen2.5-1.5b")
FORMATS: dict[str, str | None] = {"bf16": None, "none": None, "int8": "int8", "int4": "int4"}
BLOCK = 16
TINY = dict(
    bandwidth_gib=1 / 64,
    gemm_size=128,
    hw_repeats=2,
    repeats=2,
    prefill_rows=32,
    prefill_repeats=1,
    steps=2,
    prompt_len=16,
    prefill_layers=0,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="names under benchmarks/shapes/")
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help="a model instead of the shapes (repeatable), e.g. dummy:DIR",
    )
    p.add_argument(
        "--quantization", default="bf16,int8,int4", help="comma list: bf16 (none), int8, int4"
    )
    p.add_argument("--batches", default="1,4,16", help="decode batch sizes (rows)")
    p.add_argument("--prefill-rows", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="decode passes over the linears (best)")
    p.add_argument("--prefill-layers", type=int, default=4, help="layers timed at prefill (0: all)")
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument(
        "--prefill-budget",
        type=float,
        default=3.0,
        help="seconds after which no further prefill pass runs",
    )
    p.add_argument("--steps", type=int, default=5, help="decode steps per breakdown (median)")
    p.add_argument("--prompt-len", type=int, default=64, help="context of the decode steps")
    p.add_argument("--bandwidth-gib", type=float, default=2.0, help="read buffer (>> L3)")
    p.add_argument("--gemm-size", type=int, default=4096, help="square GEMM of the peaks")
    p.add_argument("--hw-repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--no-breakdown", action="store_true", help="skip the engine steps")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke run, not figures")
    first, _ = p.parse_known_args(argv)
    if first.tiny:
        p.set_defaults(**TINY)
    args = p.parse_args(argv)
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.formats = args.quantization.split(",")
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        p.error(f"--quantization: unknown {unknown} (choose from {sorted(FORMATS)})")
    if args.model:
        args.models = [(Path(m.removeprefix("dummy:")).name or m, m) for m in args.model]
    else:
        args.models = [(s, f"dummy:{SHAPES_DIR / s}") for s in args.shapes.split(",")]
    return args


def decode_rounds(model: Any, args: argparse.Namespace, into: dict[str, Any]) -> None:
    """One round of decode passes per batch, kept where faster than the round before: the
    rounds run apart (before and after the prefill and steps), so a neighbour's burst of
    memory traffic during one does not stand as the figure."""
    for b in args.batch_list:
        lt = decode_linears(model, b, args.repeats)
        best = into.get(str(b))
        stream = (
            lt.stream_seconds if best is None else min(best["stream_seconds"], lt.stream_seconds)
        )
        if best is None or lt.seconds < best["seconds"]:
            into[str(b)] = {"seconds": lt.seconds, "by_kind": lt.by_kind}
        into[str(b)]["stream_seconds"] = stream


def run_format(spec: str, fmt: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of one model in one format, in seconds, bytes and FLOPs (ratios to
    the floors come at the end: report.py); the model is freed on return."""
    steps_run = steps_needed(args.steps)
    per_batch = [
        DecodeBatch.blocks_needed(b, args.prompt_len, steps_run, BLOCK) for b in args.batch_list
    ]
    config = EngineConfig.from_kwargs(
        model=spec,
        dtype="bfloat16",
        quantization=FORMATS[fmt],
        num_kv_blocks=sum(per_batch),
        block_size=BLOCK,
        max_model_len=args.prompt_len + steps_run + BLOCK,
    )
    start = time.perf_counter()
    runner, _ = create_model_runner(config)
    model = runner.model
    nbytes = bytes_by_kind(model)
    out: dict[str, Any] = {
        "load_s": time.perf_counter() - start,
        "num_layers": model.arch.num_layers,
        "weight_bytes": sum(nbytes.values()),
        "bytes_by_kind": nbytes,
        "decode": {},
        "steps": {},
    }
    decode_rounds(model, args, out["decode"])
    rows, layers = args.prefill_rows, prefill_layers(model, args.prefill_layers)
    lt = prefill_linears(
        model, rows, args.prefill_layers, args.prefill_repeats, args.prefill_budget
    )
    out["prefill"] = {
        "rows": rows,
        "layers": len(layers) * model.arch.num_layers // len(projections(model)),
        "flops": sum(flops_by_kind(model, rows, layers).values()),
        "seconds": lt.seconds,
        "by_kind": lt.by_kind,
    }
    if not args.no_breakdown:
        first = 0
        for b, blocks in zip(args.batch_list, per_batch, strict=True):
            bd = breakdown(runner, b, args.prompt_len, args.steps, first)
            first += blocks
            out["steps"][str(b)] = {
                "seconds": bd.step,
                "plain_seconds": bd.plain_step,
                "parts": bd.parts,
                "rest_over_linears": bd.rest_over_linears(),
            }
    decode_rounds(model, args, out["decode"])  # a second round, tens of seconds later
    del runner, model
    gc.collect()
    return out


def _commit() -> str:
    def git(*cmd: str) -> str:
        run = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, check=False)
        return run.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    run: dict[str, Any] = {
        "command": " ".join(["benchmarks/floor.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": _commit(),
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_start": os.getloadavg()[0],
    }
    print(
        f"{run['cpu']}, {run['threads']} threads, torch {run['torch']}, commit {run['commit']},"
        f" load average {run['load_average_start']:.1f}"
    )
    floors = measure_floors(int(args.bandwidth_gib * GIB), args.gemm_size, args.hw_repeats)
    print(floors.describe(), flush=True)
    run["models"] = {}
    for name, spec in args.models:
        if run["models"]:  # bracket every model's runs with the floors
            floors.remeasure(args.hw_repeats)
        formats: dict[str, Any] = {}
        for fmt in args.formats:
            t = time.perf_counter()
            formats[fmt] = run_format(spec, fmt, args)
            print(
                f"  {name} {fmt}: measured in {time.perf_counter() - t:.0f} s (load "
                f"{formats[fmt]['load_s']:.0f} s), load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        run["models"][name] = {"spec": spec, "formats": formats}
    floors.remeasure(args.hw_repeats)
    run["hardware"] = floors.as_dict()
    add_ratios(run, floors)
    run["load_average_end"] = os.getloadavg()[0]
    run["seconds"] = time.perf_counter() - started
    print(f"\n{floors.describe()}")
    for name, model in run["models"].items():
        print_model(name, model, floors, args)
    print(
        f"\nload average {run['load_average_start']:.1f} at the start, "
        f"{run['load_average_end']:.1f} at the end; {run['seconds']:.0f} s in all"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
