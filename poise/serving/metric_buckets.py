"""The metric name prefix and the histogram buckets of poise's Prometheus metrics
(serving/metrics.py): seconds for latencies and token gaps, counts for step shapes."""

from __future__ import annotations

P = "poise:"

# Seconds: from a millisecond up to ten minutes (slow CPUs, long prompts, deep queues).
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 600.0,
)  # fmt: skip
# Per-token gaps: sub-millisecond on a GPU to seconds on a busy CPU.
TOKEN_GAP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0,
)  # fmt: skip
STEP_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
UTILISATION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
SERVED = ("stop", "length")
