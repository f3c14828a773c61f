"""Calibration: the simulator's free terms estimated from measurements of an idle server.

What the simulator cannot know from a profile is how this machine behaves *now* and what a
request costs before the engine sees it. Both are read from concurrency-1 cells (one request
at a time, so every number is the server's own, with no queueing in it), never from a cell the
simulation will be compared with:

- request overhead (``ArrivalModel.request_overhead_s``): the median response-header latency.
  poise sends headers once the engine has taken the request, and an idle engine takes it at
  once, so this is the request's way in (client, HTTP, template, tokenization). Measured
  directly rather than as "TTFT minus simulated prefill": that residual goes to 0 whenever the
  time scale overshoots;
- its spread (``request_overhead_cv``): the coefficient of variation of the same latencies;
- the way in per prompt token (``way_in_s_per_token``): the slope of header latency over
  prompt tokens, when the cells hold prompts of clearly different lengths (None otherwise: a
  cell of one prompt length cannot separate it from the fixed part); or timed directly with
  the server's own template and tokenizer (``time_per_token``);
- time scale (``CostModel.time_scale``): with a step trace of the cell (``poise serve
  --step-trace``), the server's measured step times over the model's prediction for the same
  steps; without one, the median measured TPOT over the model's predicted decode step;
- step jitter (``step_jitter_cv``): with a trace, the CV of measured / predicted over the
  cell's steps (steps of one shape at c=1, so their spread is the machine's); without one, the
  CV of the client's inter-token gaps after the first two tokens (a detokenizer that holds a
  token back merges two steps into one gap, so this overstates it 2-3x).

Pooling: each cell (one round of a measurement) gives its own time scale and jitter; several
cells pool by their mean (``pool``), and a cell measured between two calibration cells takes
the mean of the two around it (``bracket``): the machine drifts within minutes. Request
overheads pool over all requests of all cells.

Stdlib only, and free of ``poise.bench``: a bench record is turned into ``RequestTiming``s by
``poise.lab.calibration``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from poise.sim.arrival import ArrivalModel
from poise.sim.cost import CostModel, StepShape
from poise.sim.trace import TracedStep, predicted_vs_measured

# How much longer the longest calibration prompt must be than the shortest for the way in per
# token to be estimated from header latencies (see way_in_per_token).
WAY_IN_MIN_SPREAD = 2.0

# The model terms calibration sets (CostModel and ArrivalModel fields).
CALIBRATED = (
    "time_scale",
    "step_jitter_cv",
    "request_overhead_s",
    "request_overhead_cv",
    "way_in_s_per_token",
)


@dataclass(frozen=True)
class RequestTiming:
    """What calibration reads of one measured request (seconds, the client's clock)."""

    header_latency_s: float | None  # send -> response headers
    tpot_s: float | None  # (e2e - ttft) / (n_out - 1)
    token_gaps_s: tuple[float, ...] = ()  # gaps between text events after the first two
    prompt_tokens: int | None = None
    output_tokens: int | None = None


@dataclass(frozen=True)
class CalibrationCell:
    """One concurrency-1 cell: its measured requests and, when known, its traced steps."""

    requests: tuple[RequestTiming, ...]
    steps: tuple[TracedStep, ...] | None = None
    source: str = ""


@dataclass(frozen=True)
class CellCalibration:
    """What one cell says of the machine: its time scale and step jitter, and from what."""

    time_scale: float
    step_jitter_cv: float
    source: str  # "step-trace" or "tpot"


@dataclass(frozen=True)
class Calibration:
    request_overhead_s: float
    request_overhead_cv: float
    way_in_s_per_token: float | None
    cells: tuple[CellCalibration, ...]

    @property
    def time_scale(self) -> float:
        return pool([c.time_scale for c in self.cells])

    @property
    def step_jitter_cv(self) -> float:
        return pool([c.step_jitter_cv for c in self.cells])

    def apply(
        self, cost_model: CostModel, arrival: ArrivalModel, keep: Sequence[str] = ()
    ) -> tuple[CostModel, ArrivalModel]:
        """The models with the calibrated terms, except the fields named in ``keep`` (set by
        the user). The way-in worker count is never calibrated; the per-token way in only
        when the cells could separate it; the overhead's spread only without way-in workers:
        a queue sets the order requests reach the engine in (send order), the spread would
        shuffle it again (docs/simulator.md, Client model)."""
        step: dict[str, Any] = {
            "time_scale": self.time_scale,
            "step_jitter_cv": self.step_jitter_cv,
        }
        client: dict[str, Any] = {"request_overhead_s": self.request_overhead_s}
        if arrival.way_in_workers == 0:
            client["request_overhead_cv"] = self.request_overhead_cv
        if self.way_in_s_per_token is not None:
            client["way_in_s_per_token"] = self.way_in_s_per_token
        cost_model = dataclasses.replace(
            cost_model, **{k: v for k, v in step.items() if k not in keep}
        )
        arrival = dataclasses.replace(arrival, **{k: v for k, v in client.items() if k not in keep})
        return cost_model, arrival

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_overhead_s": self.request_overhead_s,
            "request_overhead_cv": self.request_overhead_cv,
            "way_in_s_per_token": self.way_in_s_per_token,
            "time_scale": self.time_scale,
            "step_jitter_cv": self.step_jitter_cv,
            "cells": [dataclasses.asdict(c) for c in self.cells],
        }


# ---- estimators -------------------------------------------------------------------------------
def coefficient_of_variation(xs: Sequence[float]) -> float:
    """Population standard deviation over mean; 0 for fewer than two values or a mean <= 0."""
    if len(xs) < 2 or statistics.mean(xs) <= 0:
        return 0.0
    return statistics.pstdev(xs) / statistics.mean(xs)


def request_overhead(latencies: Sequence[float]) -> float:
    """The (upper) median header latency: a request's way in on an idle server."""
    if not latencies:
        raise ValueError("calibration: no response header times to calibrate from")
    return sorted(latencies)[len(latencies) // 2]


def way_in_per_token(latencies: Sequence[float], prompt_tokens: Sequence[int]) -> float | None:
    """Seconds per prompt token of the way in: the least-squares slope of header latency over
    prompt length (clamped at 0). None unless the longest prompt is at least
    ``WAY_IN_MIN_SPREAD`` times the shortest: prompts of one length salted differently (a few
    tokens apart) would turn the latency's noise into a slope of milliseconds per token."""
    if not prompt_tokens or max(prompt_tokens) < WAY_IN_MIN_SPREAD * max(min(prompt_tokens), 1):
        return None
    mx, my = statistics.mean(prompt_tokens), statistics.mean(latencies)
    sxx = sum((x - mx) ** 2 for x in prompt_tokens)
    sxy = sum((x - mx) * (y - my) for x, y in zip(prompt_tokens, latencies, strict=True))
    return max(0.0, sxy / sxx)


def trace_time_scale(model: CostModel, steps: Sequence[TracedStep]) -> float:
    """Measured over predicted wall time, summed over the steps (time-weighted)."""
    ratio = predicted_vs_measured(model, steps).ratio
    if not ratio > 0:  # also NaN: nothing predicted
        raise ValueError("calibration: the cost model predicts no time for the traced steps")
    return ratio


def trace_step_jitter(model: CostModel, steps: Sequence[TracedStep]) -> float:
    """CV of measured / predicted over the steps (one cell, one round: the drift between
    rounds, which the time scale carries, stays out)."""
    ratios = []
    for s in steps:
        predicted = model.step_time(s.shape)
        if predicted > 0:
            ratios.append(s.wall_s / predicted)
    return coefficient_of_variation(ratios)


def decode_shape(context: int) -> StepShape:
    """One request decoding one token that attends to ``context`` tokens (itself included)."""
    return StepShape(
        num_tokens=1,
        num_seqs=1,
        num_sampled=1,
        num_decode_seqs=1,
        decode_ctx_tokens=context,
        kv_tokens=context,
        decode_max_ctx=context,
        decode_unique_ctx_tokens=context,
    )


def predicted_tpot(model: CostModel, prompt_tokens: int, output_tokens: int) -> float:
    """A lone request's TPOT under the model at time scale 1: the mean of its decode steps
    (tokens 2..n, at contexts prompt+1 .. prompt+n-1) plus the step overhead."""
    contexts = range(prompt_tokens + 1, prompt_tokens + output_tokens)
    times = [model.step_time(decode_shape(c)) + model.step_overhead_s for c in contexts]
    return statistics.mean(times)


def tpot_time_scale(model: CostModel, requests: Sequence[RequestTiming]) -> float:
    """Median measured TPOT over the median predicted one, over requests with >= 2 tokens."""
    measured, predicted = [], []
    for r in requests:
        if r.tpot_s is None or r.prompt_tokens is None or not r.output_tokens:
            continue
        if r.output_tokens < 2:
            continue
        measured.append(r.tpot_s)
        predicted.append(predicted_tpot(model, r.prompt_tokens, r.output_tokens))
    if not measured:
        raise ValueError("calibration: no request with a TPOT and its token counts")
    denominator = statistics.median(predicted)
    if denominator <= 0:
        raise ValueError("calibration: the cost model predicts no time for a decode step")
    return statistics.median(measured) / denominator


def gap_jitter(requests: Sequence[RequestTiming]) -> float:
    """CV of the client's inter-token gaps (an upper bound on the step jitter)."""
    return coefficient_of_variation([g for r in requests for g in r.token_gaps_s])


def calibrate_cell(model: CostModel, cell: CalibrationCell) -> CellCalibration:
    """One cell's time scale and jitter: from its step trace when it has one."""
    if cell.steps:
        return CellCalibration(
            trace_time_scale(model, cell.steps), trace_step_jitter(model, cell.steps), "step-trace"
        )
    return CellCalibration(tpot_time_scale(model, cell.requests), gap_jitter(cell.requests), "tpot")


def calibrate(model: CostModel, cells: Sequence[CalibrationCell]) -> Calibration:
    """Every estimator over the concurrency-1 ``cells`` (request overheads pooled over all
    their requests; time scale and jitter per cell, see ``Calibration``)."""
    if not cells:
        raise ValueError("calibration: no concurrency-1 cell to calibrate from")
    reqs = [r for c in cells for r in c.requests]
    timed = [r for r in reqs if r.header_latency_s is not None]
    latencies = [r.header_latency_s for r in timed if r.header_latency_s is not None]
    sized = [r for r in timed if r.prompt_tokens is not None]
    return Calibration(
        request_overhead_s=request_overhead(latencies),
        request_overhead_cv=coefficient_of_variation(latencies),
        way_in_s_per_token=way_in_per_token(
            [r.header_latency_s or 0.0 for r in sized], [r.prompt_tokens or 0 for r in sized]
        ),
        cells=tuple(calibrate_cell(model, c) for c in cells),
    )


# ---- pooling ------------------------------------------------------------------------------------
def pool(xs: Sequence[float]) -> float:
    """Several cells' estimates of one machine term: their mean."""
    if not xs:
        raise ValueError("calibration: nothing to pool")
    return statistics.mean(xs)


def bracket(xs: Sequence[float], n: int) -> list[float]:
    """For ``n`` rounds measured between calibration cells ``xs`` (cell r before round r, cell
    r+1 after it): the pooled value of the two around each round; a round without a cell after
    it takes its own."""
    if len(xs) < n:
        raise ValueError(f"calibration: {len(xs)} calibration cells for {n} rounds")
    return [pool(xs[r : r + 2]) for r in range(n)]


# ---- a machine fact: the server's way in, timed ---------------------------------------------
def time_per_token(jobs: Sequence[Callable[[], int]], repeats: int = 20) -> float:
    """Seconds per token of ``jobs`` (each does the work for one prompt and returns its token
    count, e.g. the server's chat template and tokenizer): the median time of each over
    ``repeats`` runs, summed, over the tokens. Single-threaded, as poise serve's way in."""
    seconds = tokens = 0.0
    for job in jobs:
        times = []
        n = 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            n = job()
            times.append(time.perf_counter() - t0)
        seconds += statistics.median(times)
        tokens += n
    if tokens <= 0:
        raise ValueError("calibration: the way-in jobs produced no tokens")
    return seconds / tokens
