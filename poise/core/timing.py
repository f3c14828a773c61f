"""The one place where request latencies are derived from request timestamps.

Definitions (all in seconds; TTFT is measured from arrival everywhere):
- ingress_time = enqueued - arrival             (the way in: chat template, tokenization,
                 waiting for the engine thread; 0 where the engine took it in on arrival)
- queue_time   = first_scheduled - enqueued
- prefill_time = first_token - first_scheduled  (includes chunked-prefill steps and waits
                 between them), split as
    prefill_compute     = time of the steps that fed its prompt chunks
    first_token_sched   = prefill_time - prefill_compute (waits between its chunks)
- ttft         = first_token - arrival
               = ingress_time + queue_time + prefill_compute + first_token_sched
- decode_time  = last token - first_token
- tpot         = decode_time / (n_output - 1)    (None with fewer than two tokens)
- itl          = gaps between consecutive output tokens
- e2e          = finished - arrival
Prometheus metrics, per-request responses, benchmarks and the simulator all call ``derive``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from poise.core.request import RequestTimes


@dataclass(frozen=True)
class RequestMetrics:
    queue_time: float | None
    ingress_time: float | None
    prefill_compute: float | None
    first_token_sched: float | None
    prefill_time: float | None
    ttft: float | None
    decode_time: float | None
    tpot: float | None
    e2e: float | None
    num_output_tokens: int
    itl: list[float] = field(default_factory=list)


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else max(0.0, end - start)


def derive(times: RequestTimes) -> RequestMetrics:
    tokens = times.token_times
    n = len(tokens)
    decode_time = _diff(tokens[-1], times.first_token) if n else None
    tpot = decode_time / (n - 1) if decode_time is not None and n > 1 else None
    enqueued = times.arrival if times.enqueued is None else times.enqueued
    prefill_time = _diff(times.first_token, times.first_scheduled)
    # The compute part can't exceed the span it lies in (clock granularity, abort mid-step).
    compute = None if prefill_time is None else min(times.prefill_compute, prefill_time)
    sched = None if compute is None or prefill_time is None else prefill_time - compute
    return RequestMetrics(
        queue_time=_diff(times.first_scheduled, enqueued),
        ingress_time=_diff(enqueued, times.arrival),
        prefill_compute=compute,
        first_token_sched=sched,
        prefill_time=prefill_time,
        ttft=_diff(times.first_token, times.arrival),
        decode_time=decode_time,
        tpot=tpot,
        e2e=_diff(times.finished, times.arrival),
        num_output_tokens=n,
        itl=[b - a for a, b in zip(tokens, tokens[1:], strict=False)],
    )


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)
