"""What the serving metrics cost the engine thread per step, at a given batch size.

Replays what one decode step at batch B hands ``ServingMetrics`` (one StepStats, B token
deltas with live RequestTimes, the live page's sums) and times it. Compare with the step
duration of a real run at the same concurrency (``poise:step_duration_seconds``), e.g. from
``benchmarks/serving.py``.

    .venv/bin/python benchmarks/metrics_cost.py [--batch 32] [--steps 2000]
"""

from __future__ import annotations

import argparse
import time

from poise.core.outputs import RequestDelta, StepStats
from poise.core.request import RequestTimes
from poise.serving.metrics import ServingMetrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    metrics = ServingMetrics("m")
    times = [
        RequestTimes(
            arrival=0.0, enqueued=0.01, first_scheduled=0.02, first_token=0.1, token_times=[0.1]
        )
        for _ in range(args.batch)
    ]
    now = 0.1
    start = time.perf_counter()
    for step in range(args.steps):
        now += 0.05
        stats = StepStats(
            step,
            now - 0.05,
            now,
            0,
            args.batch,
            args.batch,
            0,
            0.3,
            0,
            num_decode_requests=args.batch,
            token_budget=2048,
        )
        metrics.observe_step(stats)
        for i, t in enumerate(times):
            t.token_times.append(now)
            metrics.observe_delta(RequestDelta(f"r{i}", [1], times=t), None)
    per_step = (time.perf_counter() - start) / args.steps
    print(
        f"batch {args.batch}: {per_step * 1e6:.0f} us of metrics per decode step "
        f"({per_step * 1e6 / args.batch:.1f} us per token)"
    )


if __name__ == "__main__":
    main()
