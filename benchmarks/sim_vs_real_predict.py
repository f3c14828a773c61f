"""The simulated side of benchmarks/sim_vs_real.py: the variants' cost and arrival models,
calibrated from the c=1 cells only, and one simulation of a cell."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sim_vs_real_measure import Run, engine_config

from poise.bench.bench_config import BenchConfig, WorkloadSpec
from poise.config import EngineConfig
from poise.lab.calibration import calibration_cells, pooled_metrics
from poise.lab.sim_bridge import simulate_matrix
from poise.sim import calibrate as cal
from poise.sim.arrival import ArrivalModel
from poise.sim.cost import CostModel
from poise.sim.tokens import PromptLengths

# The prediction the target is judged on (its median over --sim-seeds seeds): calibrated only
# from the c=1 cell, with the server's way in as it is.
PRIMARY = "calibrated per round (c=1 step-trace scale and jitter)"


def way_in_s_per_token(config: EngineConfig) -> float:
    """Seconds per prompt token that poise serve's one tokenizer thread spends on a seed
    request (chat template + tokenization), timed with the server's own functions. A machine
    fact, not fitted to any cell."""
    from poise.text.tokenizer import apply_chat_template, load_tokenizer
    from poise.workload import seed_classes

    tok = load_tokenizer(config.model.tokenizer or config.model.model)

    def job(prompt: str) -> Callable[[], int]:
        return lambda: len(apply_chat_template(tok, [{"role": "user", "content": prompt}]))

    return cal.time_per_token([job(c.prompt or "") for c in seed_classes()])


def simulate(
    spec: WorkloadSpec,
    config: EngineConfig,
    model: CostModel,
    arrival: ArrivalModel,
    out: Path,
    label: str,
) -> Path:
    cfg = BenchConfig.for_workload(spec, base_url="simulated://", model=model.name, scrape=False)
    record = simulate_matrix(cfg, config, model, PromptLengths(), arrival)
    record.provenance["label"] = label
    return record.save(out)


Flags = Callable[[int, int], tuple[CostModel, ArrivalModel]]  # (concurrency, round) -> models


def calibrated_variants(
    run: Run, model: CostModel, speed_rounds: dict[str, list[float]]
) -> tuple[list[tuple[str, str, Flags, int]], dict[str, Any]]:
    """The calibrated variants (name, tag, models per cell and round, seeds) and what they
    were calibrated to."""
    a = run.a
    # Every c=1 cell: one per round and one closing the window (runs from before it: none).
    paths = [run.real("cal", r) for r in range(a.rounds + 1) if run.real("cal", r).exists()]
    cells = [c for p in paths for c in calibration_cells(p)]
    pooled = cal.calibrate(model, cells)
    n = a.rounds
    # Round r's cells ran between c=1 cells r and r+1: each value is the mean of the two.
    trace_scales = cal.bracket([cal.trace_time_scale(model, c.steps or ()) for c in cells], n)
    trace_cvs = cal.bracket([cal.trace_step_jitter(model, c.steps or ()) for c in cells], n)
    tpot_scales = cal.bracket([cal.tpot_time_scale(model, c.requests) for c in cells], n)
    gap_cvs = cal.bracket([cal.gap_jitter(c.requests) for c in cells], n)
    way_in = way_in_s_per_token(engine_config(a.engine))
    # poise serve's way in as it is: the client and HTTP part of the overhead overlaps, the
    # chat template and tokenization run on one thread, in arrival order.
    queued = ArrivalModel(pooled.request_overhead_s, 0.0, 1, way_in)
    independent = ArrivalModel(pooled.request_overhead_s, pooled.request_overhead_cv)

    def timed(scale: float, cv: float) -> CostModel:
        return dataclasses.replace(model, time_scale=scale, step_jitter_cv=cv)

    variants: list[tuple[str, str, Flags, int]] = [
        (
            PRIMARY,
            "trace",
            lambda c, r: (timed(trace_scales[r], trace_cvs[r]), queued),
            a.sim_seeds,
        ),
        (
            "calibrated (c=1 TPOT scale, client gaps' jitter)",
            "tpot",
            lambda c, r: (timed(tpot_scales[r], gap_cvs[r]), queued),
            a.sim_seeds,
        ),
        (
            "calibrated (c=1 step-trace scale), independent way in",
            "random",
            lambda c, r: (timed(trace_scales[r], trace_cvs[r]), independent),
            a.sim_seeds,
        ),
        (
            "diagnostic: each cell's own step-trace scale",
            "oracle",
            lambda c, r: (timed(speed_rounds[f"c{c}"][r], trace_cvs[r]), queued),
            1,
        ),
    ]
    facts = {
        "request_overhead_s": pooled.request_overhead_s,
        "request_overhead_cv": pooled.request_overhead_cv,
        "way_in_s_per_token": way_in,
        "trace_scale_by_round": trace_scales,
        "trace_step_jitter_cv_by_round": trace_cvs,
        "tpot_scale_by_round": tpot_scales,
        "gap_jitter_cv_by_round": gap_cvs,
        "real_c1": pooled_metrics(paths),
    }
    print(
        f"calibration: request overhead {pooled.request_overhead_s * 1000:.1f} ms (CV "
        f"{pooled.request_overhead_cv:.2f}), way in {way_in * 1e6:.2f} us/token on one thread; "
        f"per round: step-trace scale {', '.join(f'{x:.3f}' for x in trace_scales)} (jitter CV "
        f"{', '.join(f'{x:.3f}' for x in trace_cvs)}), TPOT scale "
        f"{', '.join(f'{x:.3f}' for x in tpot_scales)}"
    )
    return variants, facts
