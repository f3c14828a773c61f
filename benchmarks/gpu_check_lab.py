"""The seed lab's configs A / B / C in the GPU check (benchmarks/gpu_check.py): one poise server
per config (poise.lab.presets sizes: the lab's own on CUDA, scaled down by 8 on the CPU),
each measured by ``poise bench``'s ``run_matrix`` at concurrency 8 / 16 / 32 with the seed's
SHORT/LONG mix (a quarter LONG prompts); config A's server first runs a closed-loop
concurrency-1 cell of a few requests, the record ``poise simulate --calibrate-from`` reads,
which calibrates the roofline model of the GPU. Each record is saved next to the check's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from poise.bench.bench_config import BenchConfig, WorkloadSpec
from poise.bench.stats import cell_metrics
from poise.checkpoint.embedded import embedded_gguf_path
from poise.lab.managed_server import ManagedServer
from poise.lab.presets import plan
from poise.lab.sweep import spec_from_dict

CONCURRENCY = (8, 16, 32)
LONG_RATIO = 0.25
# The embedded SmolLM2 tokenizer's vocabulary: dummy-weight models sample any id of their own
# vocabulary, so theirs is cut to what the tokenizer can decode (a ~5% smaller lm_head on
# the 7B shape).
TOKENIZER_VOCAB = 49152


def dummy_config(base: dict[str, Any], path: Path) -> str:
    """``dummy:<path>``: ``base`` (a config.json's fields) with the tokenizer's vocabulary."""
    config = {**base, "vocab_size": TOKENIZER_VOCAB, "bos_token_id": 1, "eos_token_id": 2}
    path.write_text(json.dumps(config))
    return f"dummy:{path}"


def workload(dry_run: bool, calibration: bool = False) -> WorkloadSpec:
    """The lab cells (requests per cell: two rounds of the largest client count on a GPU, a
    handful dry), or the concurrency-1 calibration cell (a few requests: one at a time)."""
    return WorkloadSpec(
        concurrency=(1,) if calibration else CONCURRENCY,
        long_ratio=(LONG_RATIO,),
        max_tokens=8 if dry_run else 160,
        num_requests=4 if dry_run else (8 if calibration else 64),
        warmup=1 if dry_run else 2,
        long_repeat=5 if dry_run else 220,
        timeout_s=120 if dry_run else 300,
    )


def _measure(
    server: ManagedServer, wl: WorkloadSpec, device_name: str, server_args: dict[str, Any]
) -> Any:
    from poise.bench.runner import run_matrix

    cfg = BenchConfig.for_workload(
        wl,
        base_url=server.base_url,
        scrape=False,
        gpu=device_name,
        engine="poise",
        server_args=server_args,
    )
    record = asyncio.run(run_matrix(cfg))
    if not record.capabilities.get("ok"):
        raise RuntimeError(f"{server.spec.name}: probe failed: {record.capabilities['error']}")
    return record


def run_lab(
    model: str, device: str, out_dir: Path, dry_run: bool, device_name: str
) -> tuple[list[dict[str, Any]], Path]:
    """Every config's cells: one row per (config, concurrency), each config's record saved
    as ``<out_dir>/lab-<config>.yaml``; and the path of the calibration record."""
    preset = plan("lab", device=device, model=model)
    rows = []
    calibration: Path | None = None
    for spec_dict in preset.configs:
        args = {**spec_dict["args"], "tokenizer": str(embedded_gguf_path())}
        if dry_run:  # tiny shapes: a small pool, the CPU's own attention
            args["num_kv_blocks"] = 512
        spec = spec_from_dict({**spec_dict, "args": args}, spec_dict["name"])
        spec = dataclasses.replace(spec, startup_timeout_s=600.0, grace_s=5.0)
        with ManagedServer(spec, out_dir / "logs" / f"{spec.name}.log") as server:
            if calibration is None:
                c1 = _measure(server, workload(dry_run, True), device_name, dict(spec.args))
                calibration = c1.save(out_dir / f"calibration-{spec.name}.yaml")
            record = _measure(server, workload(dry_run), device_name, dict(spec.args))
        path = record.save(out_dir / f"lab-{spec.name}.yaml")
        for cell in record.cells:
            overall = cell_metrics(cell.records)["overall"]
            rows.append(
                {
                    "config": spec.name,
                    "record": path.name,
                    "concurrency": cell.load["concurrency"],
                    "long_ratio": LONG_RATIO,
                    "requests_ok": overall["num_ok"],
                    "output_tokens_per_s": _round(overall["output_tokens_per_s"]),
                    "p50_ttft_ms": _round(overall["ttft_ms"]["p50"]),
                    "p95_ttft_ms": _round(overall["ttft_ms"]["p95"]),
                    "p50_tpot_ms": _round(overall["tpot_ms"]["p50"]),
                }
            )
    assert calibration is not None
    return rows, calibration


def _round(x: Any) -> float | None:
    return None if x is None else round(float(x), 2)


def calibrate(record: Path, shape: str, accelerator: str) -> dict[str, Any]:
    """What ``poise simulate --calibrate-from RECORD --accelerator A`` makes of the record:
    the roofline model of ``shape`` on ``accelerator``, calibrated."""
    from poise.lab.calibration import calibrate_from_records
    from poise.sim.roofline import RooflineCostModel

    model = RooflineCostModel.build(shape, accelerator, dtype="bfloat16")
    calibration = calibrate_from_records([record], model)
    return {
        "record": record.name,
        "accelerator": accelerator,
        "cost_model": model.name,
        **calibration.to_dict(),
    }
