"""Decode and prefill of real model sizes against the hardware floor, measured in the same run.

1. The floors (hardware.py): DRAM read bandwidth (a streaming-read kernel over
   ``--bandwidth-gib``), the bf16 and int8 GEMM peaks (``--gemm-size``).
2. Per model and ``--quantization``: all of its linear layers as the model runs them
   (linear_times.py), weights resident in DRAM, one pass over every layer as a decode step
   makes; at each ``--batches`` row count, as a ratio to bytes read / DRAM bandwidth; and at
   ``--prefill-rows`` rows, as a ratio to FLOPs / bf16 peak and / int8 peak (the floor with
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
wall time: run it on an idle machine.
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
from engine_steps import DecodeBatch  # noqa: E402
from hardware import GIB, Floors, measure_floors  # noqa: E402
from linear_times import (  # noqa: E402
    HEAD,
    bytes_by_kind,
    decode_linears,
    flops_by_kind,
    prefill_linears,
)
from step_breakdown import PARTS, breakdown  # noqa: E402

from poise.config import EngineConfig  # noqa: E402
from poise.runner.factory import create_model_runner  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES_DIR = Path(__file__).resolve().parent / "shapes"
SHAPES = ("smollm2-1.7b", "llama-3.2-1b", "qwen2.5-1.5b")
FORMATS: dict[str, str | None] = {"bf16": None, "none": None, "int8": "int8", "int4": "int4"}
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", HEAD)
BLOCK = 16
TINY = dict(bandwidth_gib=1 / 64, gemm_size=128, hw_repeats=2, repeats=2, prefill_rows=32,
            prefill_repeats=1, steps=2, prompt_len=16)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="names under benchmarks/shapes/")
    p.add_argument("--model", action="append", default=None,
                   help="a model instead of the shapes (repeatable), e.g. dummy:DIR")  # fmt: skip
    p.add_argument(
        "--quantization", default="bf16,int8,int4", help="comma list: bf16 (none), int8, int4"
    )
    p.add_argument("--batches", default="1,4,16", help="decode batch sizes (rows)")
    p.add_argument("--prefill-rows", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="decode passes over the linears (best)")
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="decode steps per breakdown (median)")
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


def run_format(spec: str, fmt: str, floors: Floors, args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of one model in one format (the model is freed on return)."""
    steps_run = 2 + 2 * args.steps  # step_breakdown's: 2 unmeasured, then plain and timed
    per_batch = [DecodeBatch.blocks_needed(b, args.prompt_len, steps_run, BLOCK)
                 for b in args.batch_list]  # fmt: skip
    config = EngineConfig.from_kwargs(
        model=spec, dtype="bfloat16", quantization=FORMATS[fmt], num_kv_blocks=sum(per_batch),
        block_size=BLOCK, max_model_len=args.prompt_len + steps_run + BLOCK,
    )  # fmt: skip
    start = time.perf_counter()
    runner, _ = create_model_runner(config)
    out: dict[str, Any] = {"load_s": time.perf_counter() - start}
    model = runner.model
    nbytes = bytes_by_kind(model)
    total_bytes = sum(nbytes.values())
    bw = floors.read_bytes_per_s
    out.update(weight_bytes=total_bytes, bytes_by_kind=nbytes, decode_floor_s=total_bytes / bw)
    out["decode"] = {}
    for b in args.batch_list:
        lt = decode_linears(model, b, args.repeats)
        out["decode"][str(b)] = {
            "seconds": lt.seconds,
            "x_floor": lt.seconds / out["decode_floor_s"],
            "by_kind": {
                k: {"seconds": s, "x_floor": s / (nbytes[k] / bw)} for k, s in lt.by_kind.items()
            },  # fmt: skip
        }
    rows = args.prefill_rows
    flops = sum(flops_by_kind(model, rows).values())
    lt = prefill_linears(model, rows, args.prefill_repeats)
    out["prefill"] = {
        "rows": rows,
        "flops": flops,
        "seconds": lt.seconds,
        "x_bf16_floor": lt.seconds / (flops / floors.bf16_flops),
        "x_int8_floor": lt.seconds / (flops / floors.int8_ops),
        "by_kind_seconds": lt.by_kind,
    }
    out["steps"] = {}
    if not args.no_breakdown:
        first = 0
        for b, blocks in zip(args.batch_list, per_batch, strict=True):
            bd = breakdown(runner, b, args.prompt_len, args.steps, first)
            first += blocks
            out["steps"][str(b)] = {
                "seconds": bd.step,
                "plain_seconds": bd.plain_step,
                "x_floor": bd.step / out["decode_floor_s"],
                "parts": bd.parts,
                "rest_over_linears": bd.rest_over_linears(),
            }
    del runner, model
    gc.collect()
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def print_shape(name: str, spec: str, results: dict[str, Any], floors: Floors,
                args: argparse.Namespace) -> None:  # fmt: skip
    print(f"\n=== {name} ({spec}), load average {os.getloadavg()[0]:.1f}")
    bw = floors.read_bytes_per_s
    print(f"decode: every linear + lm_head of one step, weights in DRAM "
          f"(floor = bytes / {bw / 1e9:.1f} GB/s); ms and x floor")  # fmt: skip
    head = " | ".join(f"b={b:<3} ms  x floor" for b in args.batch_list)
    print(f"{'format':<7} {'weights':>9} {'floor ms':>9} | {head}")
    for fmt, r in results.items():
        cells = " | ".join(
            f"{_ms(r['decode'][str(b)]['seconds']):>9} {r['decode'][str(b)]['x_floor']:>8.2f}"
            for b in args.batch_list
        )
        print(f"{fmt:<7} {r['weight_bytes'] / 1e9:>7.2f}GB {_ms(r['decode_floor_s']):>9} | {cells}")
    b0 = str(args.batch_list[0])
    print(f"by layer kind at batch {b0}: ms (x floor)")
    print(f"{'format':<7} " + " ".join(f"{k:>16}" for k in KINDS))
    for fmt, r in results.items():
        kinds = r["decode"][b0]["by_kind"]
        cells = " ".join(
            f"{_ms(kinds[k]['seconds']):>8} ({kinds[k]['x_floor']:4.2f})"
            if k in kinds
            else " " * 16
            for k in KINDS
        )
        print(f"{fmt:<7} {cells}")
    rows = args.prefill_rows
    print(f"prefill: the projections at {rows} rows (floor = FLOPs / "
          f"{floors.bf16_flops / 1e9:.0f} GFLOP/s bf16, / {floors.int8_ops / 1e9:.0f} GOP/s int8)")  # fmt: skip
    print(
        f"{'format':<7} {'GFLOP':>8} {'ms':>9} {'tok/s':>8} {'x bf16 floor':>13} {'x int8 floor':>13}"
    )
    for fmt, r in results.items():
        p = r["prefill"]
        print(f"{fmt:<7} {p['flops'] / 1e9:>8.0f} {_ms(p['seconds']):>9} "
              f"{rows / p['seconds']:>8.0f} {p['x_bf16_floor']:>13.2f} {p['x_int8_floor']:>13.2f}")  # fmt: skip
    if args.no_breakdown:
        return
    print(f"decode step through ModelRunner.execute, context ~{args.prompt_len}: ms per step "
          f"(median of {args.steps}); x floor = step / weight-read floor")  # fmt: skip
    cols = " ".join(f"{p:>14}" if p == "norms/rope/act" else f"{p:>9}" for p in PARTS)
    print(
        f"{'format':<7} {'b':>3} {'step':>8} {'x floor':>8} {cols} {'rest/lin':>9} {'no timers':>9}"
    )
    for fmt, r in results.items():
        for b in args.batch_list:
            s = r["steps"][str(b)]
            parts = " ".join(
                f"{_ms(s['parts'][p]):>14}" if p == "norms/rope/act" else f"{_ms(s['parts'][p]):>9}"
                for p in PARTS
            )
            print(f"{fmt:<7} {b:>3} {_ms(s['seconds']):>8} {s['x_floor']:>8.2f} {parts} "
                  f"{s['rest_over_linears']:>9.1%} {_ms(s['plain_seconds']):>9}")  # fmt: skip


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
    print(f"{run['cpu']}, {run['threads']} threads, torch {run['torch']}, commit {run['commit']},"
          f" load average {run['load_average_start']:.1f}")  # fmt: skip
    floors = measure_floors(int(args.bandwidth_gib * GIB), args.gemm_size, args.hw_repeats)
    run["hardware"] = floors.as_dict()
    print(floors.describe())
    run["models"] = {}
    for name, spec in args.models:
        results: dict[str, Any] = {}
        for fmt in args.formats:
            t = time.perf_counter()
            results[fmt] = run_format(spec, fmt, floors, args)
            print(f"  {name} {fmt}: done in {time.perf_counter() - t:.0f} s "
                  f"(load {results[fmt]['load_s']:.0f} s)", flush=True)  # fmt: skip
        print_shape(name, spec, results, floors, args)
        run["models"][name] = {"spec": spec, "formats": results}
    run["load_average_end"] = os.getloadavg()[0]
    run["seconds"] = time.perf_counter() - started
    print(f"\nload average at the end {run['load_average_end']:.1f}; {run['seconds']:.0f} s in all")
    if args.json is not None:
        args.json.write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
