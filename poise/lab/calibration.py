"""Bench records -> simulator calibration (``poise.sim.calibrate``), and pooled real metrics.

Lives in lab because it joins bench (the record format, the metric definitions) and sim (the
estimators), which must not import each other. ``poise simulate --calibrate-from RECORD...``
and benchmarks/sim_vs_real.py both call it.

A record's step trace: a bench record knows nothing of the server it measured, so whoever ran
the server with ``--step-trace`` links the trace to the record (``link_step_trace``): the
record's ``artifacts.step_trace`` holds the trace's path (relative to the record's folder) and,
per cell, the ``[first, end)`` indexes of the steps the server ran during that cell. Without a
link the client-side estimators are used (TPOT scale, inter-token gap jitter).

Invariants: only closed-loop concurrency-1 cells are read for calibration; warm-up requests
never count; a request's header latency counts even when the request later failed (the way in
was measured), its TPOT and gaps only when it succeeded.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from poise.bench.record import ExperimentRecord
from poise.bench.stats import RequestRecord, cell_metrics, derive, percentile
from poise.sim.arrival import ArrivalModel
from poise.sim.calibrate import (
    CALIBRATED,
    Calibration,
    CalibrationCell,
    RequestTiming,
    calibrate,
)
from poise.sim.cost import CostModel
from poise.sim.trace import TracedStep, read_trace

STEP_TRACE = "step_trace"


def link_step_trace(
    record: ExperimentRecord, trace: str | Path, spans: Sequence[tuple[int, int]]
) -> None:
    """Name the server's step trace in ``record`` with each cell's ``[first, end)`` steps
    (``trace`` as it will be found from the record's folder, e.g. a bare file name)."""
    if len(spans) != len(record.cells):
        raise ValueError(f"step trace: {len(spans)} spans for {len(record.cells)} cells")
    record.artifacts[STEP_TRACE] = {"path": str(trace), "spans": [list(s) for s in spans]}


def request_timing(rec: RequestRecord) -> RequestTiming:
    stats = derive(rec)
    header = None if rec.header is None else rec.header - rec.start
    if not rec.ok:
        return RequestTiming(header, None, prompt_tokens=rec.usage_prompt_tokens)
    # Text events only: role-only and usage-only chunks carry no token.
    times = [t for t, chars in zip(rec.events, rec.event_chars, strict=False) if chars]
    gaps = tuple(b - a for a, b in zip(times[1:], times[2:], strict=False))
    return RequestTiming(header, stats.tpot, gaps, rec.usage_prompt_tokens, stats.n_out)


def _is_c1(load: dict[str, Any]) -> bool:
    return load.get("concurrency") == 1 and load.get("mode", "closed") == "closed"


def calibration_cells(path: str | Path) -> list[CalibrationCell]:
    """The concurrency-1 cells of a bench record (with its per-request JSONL), each with its
    traced steps when the record links a trace."""
    path = Path(path)
    try:
        record = ExperimentRecord.load(path)
        link = record.artifacts.get(STEP_TRACE) or {}
        steps: list[TracedStep] | None = None
        if link:
            _, steps = read_trace(path.parent / link["path"])
    except (OSError, KeyError, TypeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ValueError(f"calibration: cannot read the bench record {path}: {exc!r}") from exc
    out = []
    for i, cell in enumerate(record.cells):
        if not _is_c1(cell.load):
            continue
        if not cell.records:
            raise ValueError(f"calibration: {path} cell {i} has no per-request records")
        cell_steps = None
        if steps is not None:
            first, end = link["spans"][i]
            cell_steps = tuple(steps[first:end])
        timings = tuple(request_timing(r) for r in cell.records if not r.warmup)
        out.append(CalibrationCell(timings, cell_steps, f"{path}#{i}"))
    return out


def calibrate_from_records(paths: Sequence[str | Path], model: CostModel) -> Calibration:
    """``poise.sim.calibrate.calibrate`` over the concurrency-1 cells of ``paths``."""
    cells = [c for p in paths for c in calibration_cells(p)]
    if not cells:
        raise ValueError(
            f"calibration: no closed-loop concurrency-1 cell in {', '.join(map(str, paths))}"
        )
    return calibrate(model, cells)


def pooled_metrics(paths: Sequence[str | Path]) -> dict[str, Any]:
    """TTFT p50/p95 over the measured requests of the first cell of each record in ``paths``
    (e.g. the rounds of one load point) and output tokens/s as all their tokens over all
    their windows: what `poise bench` reports for one cell, computed over several; with each
    record's own values under ``rounds``."""
    ttfts: list[float] = []
    tpots: list[float] = []
    tokens, window = 0, 0.0
    rounds = []
    for p in paths:
        recs = ExperimentRecord.load(p).cells[0].records
        m = cell_metrics(recs)
        ov = m["overall"]
        for st in (derive(r) for r in recs if not r.warmup and r.ok):
            if st.ttft is not None:
                ttfts.append(st.ttft)
            if st.tpot is not None:
                tpots.append(st.tpot)
        tokens += ov["output_tokens"]
        window += m["window_s"]
        rounds.append(
            {
                "p50_ttft_ms": ov["ttft_ms"]["p50"],
                "p95_ttft_ms": ov["ttft_ms"]["p95"],
                "output_tokens_per_s": ov["output_tokens_per_s"],
            }
        )

    def ms(q: float, xs: list[float]) -> float:
        v = percentile(xs, q)
        return math.nan if v is None else v * 1000

    return {
        "p50_ttft_ms": ms(50, ttfts),
        "p95_ttft_ms": ms(95, ttfts),
        "output_tokens_per_s": tokens / window if window > 0 else math.nan,
        "p50_tpot_ms": ms(50, tpots),
        "num_requests": len(ttfts),
        "rounds": rounds,
    }


def calibrated_models(
    paths: Sequence[str | Path], cost_model: CostModel, arrival: ArrivalModel
) -> tuple[CostModel, ArrivalModel, Calibration]:
    """The models calibrated from the records' concurrency-1 cells; a term already set away
    from its default (by a flag: ``--time-scale 1.2``) is kept as set."""
    calibration = calibrate_from_records(paths, cost_model)
    keep = [
        f.name
        for obj in (cost_model, arrival)
        for f in dataclasses.fields(obj)
        if f.name in CALIBRATED and getattr(obj, f.name) != f.default
    ]
    cost_model, arrival = calibration.apply(cost_model, arrival, keep)
    return cost_model, arrival, calibration
