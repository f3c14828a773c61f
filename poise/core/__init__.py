"""Data contracts shared by the scheduler, the executors, the server and the simulator."""

from __future__ import annotations

from poise.core.outputs import (
    ModelRunnerOutput,
    RequestDelta,
    ScheduledRequest,
    SchedulerOutput,
    StepStats,
)
from poise.core.request import Request, RequestStatus, RequestTimes, SloTargets
from poise.core.sampling_params import SamplingParams
from poise.core.timing import RequestMetrics, derive, percentile

__all__ = [
    "ModelRunnerOutput",
    "Request",
    "RequestDelta",
    "RequestMetrics",
    "RequestStatus",
    "RequestTimes",
    "SamplingParams",
    "ScheduledRequest",
    "SchedulerOutput",
    "SloTargets",
    "StepStats",
    "derive",
    "percentile",
]
