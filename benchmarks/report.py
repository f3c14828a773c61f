"""floor.py's figures as ratios to the floors, and its tables (one set per model).

Ratios are taken at the end of the run, against the best floors measured in it (the floors
are measured at the start, between models and at the end: a neighbour's burst during one
measurement must not lower the floor that every model is held to).
"""

from __future__ import annotations

import argparse
from typing import Any

from hardware import Floors
from linear_times import HEAD
from step_breakdown import PARTS

KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", HEAD)


def add_ratios(run: dict[str, Any], floors: Floors) -> None:
    """Write each figure's floor and ratio beside it (``x_floor``), in place."""
    bw = floors.read_bytes_per_s
    for model in run["models"].values():
        for r in model["formats"].values():
            nbytes = r["bytes_by_kind"]
            r["decode_floor_s"] = r["weight_bytes"] / bw
            for d in r["decode"].values():
                d["x_floor"] = d["seconds"] / r["decode_floor_s"]
                d["x_stream"] = d["seconds"] / d["stream_seconds"]
                d["by_kind"] = {
                    k: {"seconds": s, "x_floor": s / (nbytes[k] / bw)}
                    for k, s in d["by_kind"].items()
                }
            p = r["prefill"]
            p["bf16_floor_s"] = p["flops"] / floors.bf16_flops
            p["int8_floor_s"] = p["flops"] / floors.int8_ops
            p["x_bf16_floor"] = p["seconds"] / p["bf16_floor_s"]
            p["x_int8_floor"] = p["seconds"] / p["int8_floor_s"]
            for s in r["steps"].values():
                s["x_floor"] = s["seconds"] / r["decode_floor_s"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _decode(formats: dict[str, Any], floors: Floors, batches: list[int]) -> None:
    print(
        "decode: every linear + lm_head of one step, weights in DRAM "
        f"(floor = bytes / {floors.read_bytes_per_s / 1e9:.1f} GB/s): ms, x floor; stream: the "
        "same tensors read, one call per layer, right after each pass (best), and x it"
    )
    head = " | ".join(f"{f'b={b} ms':>9} {'x floor':>7} {'x stream':>8}" for b in batches)
    print(f"{'format':<7} {'weights':>9} {'floor ms':>9} {'stream ms':>9} | {head}")
    for fmt, r in formats.items():
        d = r["decode"]
        cells = " | ".join(
            f"{_ms(d[str(b)]['seconds']):>9} {d[str(b)]['x_floor']:>7.2f}"
            f" {d[str(b)]['x_stream']:>8.2f}"
            for b in batches
        )
        stream = min(d[str(b)]["stream_seconds"] for b in batches)
        print(
            f"{fmt:<7} {r['weight_bytes'] / 1e9:>7.2f}GB {_ms(r['decode_floor_s']):>9}"
            f" {_ms(stream):>9} | {cells}"
        )
    for b in batches:
        print(f"by layer kind at batch {b}: ms (x floor)")
        print(f"{'format':<7} " + " ".join(f"{k:>16}" for k in KINDS))
        for fmt, r in formats.items():
            kinds = r["decode"][str(b)]["by_kind"]
            cells = " ".join(
                f"{_ms(kinds[k]['seconds']):>9} ({kinds[k]['x_floor']:4.2f})"
                if k in kinds
                else " " * 16
                for k in KINDS
            )
            print(f"{fmt:<7} {cells}")


def _prefill(formats: dict[str, Any], floors: Floors, num_layers: int) -> None:
    p0 = next(iter(formats.values()))["prefill"]
    print(
        f"prefill: the projections of {p0['layers']} of {num_layers} layers at {p0['rows']} rows "
        f"(floor = FLOPs / {floors.bf16_flops / 1e9:.0f} GFLOP/s bf16, "
        f"/ {floors.int8_ops / 1e9:.0f} GOP/s int8)"
    )
    print(
        f"{'format':<7} {'GFLOP':>8} {'ms':>9} {'all layers ms':>14} {'x bf16 floor':>13} "
        f"{'x int8 floor':>13}"
    )
    for fmt, r in formats.items():
        p = r["prefill"]
        whole = p["seconds"] * num_layers / p["layers"]
        print(
            f"{fmt:<7} {p['flops'] / 1e9:>8.0f} {_ms(p['seconds']):>9} {_ms(whole):>14} "
            f"{p['x_bf16_floor']:>13.2f} {p['x_int8_floor']:>13.2f}"
        )


def _steps(formats: dict[str, Any], batches: list[int], args: argparse.Namespace) -> None:
    print(
        f"decode step through ModelRunner.execute at context ~{args.prompt_len}: ms, the median "
        f"of {args.steps} steps (x floor: step / the weight-read floor; rest/lin: the step "
        "beside its linears, over them; no timers: the same steps unwrapped)"
    )
    width = {p: max(9, len(p)) for p in PARTS}
    cols = " ".join(f"{p:>{width[p]}}" for p in PARTS)
    print(
        f"{'format':<7} {'b':>3} {'step':>8} {'x floor':>7} {cols} {'rest/lin':>8} {'no timers':>9}"
    )
    for fmt, r in formats.items():
        for b in batches:
            s = r["steps"][str(b)]
            parts = " ".join(f"{_ms(s['parts'][p]):>{width[p]}}" for p in PARTS)
            print(
                f"{fmt:<7} {b:>3} {_ms(s['seconds']):>8} {s['x_floor']:>7.2f} {parts} "
                f"{s['rest_over_linears']:>8.1%} {_ms(s['plain_seconds']):>9}"
            )


def print_model(name: str, model: dict[str, Any], floors: Floors, args: argparse.Namespace) -> None:
    formats = model["formats"]
    print(f"\n=== {name} ({model['spec']})")
    _decode(formats, floors, args.batch_list)
    _prefill(formats, floors, next(iter(formats.values()))["num_layers"])
    if not args.no_breakdown:
        _steps(formats, args.batch_list, args)
