"""How much an engine step costs beyond the executor's ``execute``: the profile's step overhead.

``poise profile`` runs a short real EngineCore workload on the real runner and subtracts the
time spent inside ``execute`` from each step's wall time; what is left is scheduling and
bookkeeping, which the simulator adds to every modelled step. It lives here, not beside the
runner's grid timing (``runner/profiling.py``), because it drives the engine: the runner must
not import the engine that builds it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from poise.config import EngineConfig
from poise.core.sampling_params import SamplingParams
from poise.engine.core import EngineCore, EngineLimits
from poise.engine.executor import Executor
from poise.engine.observer import StepTimer


def measure_engine_overhead(
    config: EngineConfig,
    runner: Executor,
    info: EngineLimits,
    num_requests: int = 8,
    max_tokens: int = 12,
    tick: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds per engine step spent outside ``runner.execute`` (scheduler, updates)."""
    timer = StepTimer(tick)
    engine = EngineCore.for_model(config, runner, info, observers=[timer])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"o{i}", [11 + (i + j) % 50 for j in range(24)], params)
    overheads: list[float] = []
    while engine.has_unfinished_requests():
        n_before = len(timer.durations)
        t0 = tick()
        engine.step()
        total = tick() - t0
        if len(timer.durations) > n_before:
            overheads.append(max(0.0, total - timer.durations[-1]))
    return statistics.median(overheads) if overheads else 0.0
