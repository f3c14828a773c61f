"""Head-of-line blocking seen from the client: how long prompts' prefills hurt the others.

A long request's *prefill window* is [sent, first token] (queueing included: the client
cannot tell them apart). For every other request we ask two questions:
- TTFT: did its own wait for a first token overlap some long prefill window? TTFT is then
  summarised separately for overlapping and clear requests.
- Decode stalls: a gap between its token events longer than ``stall_factor`` x the median
  gap of the cell is a stall; we count stalls among gaps that overlap a long prefill and among
  gaps that do not, giving P(stall | long prefill) against P(stall | none).
Pure functions over RequestRecords (warmup long requests still block others, so they count
as blockers; only measured requests are judged).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from poise.bench.stats import RequestRecord, percentile, summarize


def _overlaps(a0: float, a1: float, windows: Sequence[tuple[float, float]]) -> bool:
    return any(w0 < a1 and a0 < w1 for w0, w1 in windows)


def prefill_interference(
    records: Sequence[RequestRecord], long_class: str = "long", stall_factor: float = 2.0
) -> dict[str, Any] | None:
    """None when the cell has no long requests or nothing else to judge."""
    windows = [(r.start, r.events[0]) for r in records if r.class_name == long_class and r.events]
    judged = [
        r for r in records if r.class_name != long_class and r.ok and r.events and not r.warmup
    ]
    if not windows or not judged:
        return None
    gaps = [b - a for r in judged for a, b in zip(r.events, r.events[1:], strict=False)]
    median = percentile(gaps, 50) or 0.0
    threshold = stall_factor * median
    hit_ttft: list[float] = []
    clear_ttft: list[float] = []
    stalls = {"overlap": [0, 0], "clear": [0, 0]}  # [stalls, gaps]
    for r in judged:
        ttft = r.events[0] - r.start
        (hit_ttft if _overlaps(r.start, r.events[0], windows) else clear_ttft).append(ttft)
        for a, b in zip(r.events, r.events[1:], strict=False):
            key = "overlap" if _overlaps(a, b, windows) else "clear"
            stalls[key][1] += 1
            stalls[key][0] += int(median > 0 and b - a > threshold)

    def rate(key: str) -> float | None:
        n_stall, n_gap = stalls[key]
        return n_stall / n_gap if n_gap else None

    return {
        "long_class": long_class,
        "num_long_prefills": len(windows),
        "ttft_ms_overlapping_long_prefill": summarize(hit_ttft),
        "ttft_ms_clear": summarize(clear_ttft),
        "stall_threshold_ms": threshold * 1000,
        "p_stall_during_long_prefill": rate("overlap"),
        "p_stall_otherwise": rate("clear"),
        "gaps_during_long_prefill": stalls["overlap"][1],
        "gaps_otherwise": stalls["clear"][1],
    }
