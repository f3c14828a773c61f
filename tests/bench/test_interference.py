"""Prefill interference: TTFT and stall rates split by overlap with long prefills."""

from __future__ import annotations

import pytest

from poise.bench.interference import prefill_interference
from poise.bench.stats import RequestRecord


def rec(i: int, cls: str, start: float, times: list[float], warmup: bool = False) -> RequestRecord:
    return RequestRecord.from_token_times(i, cls, start, times, warmup=warmup)


def test_overlap_split_and_stall_rates() -> None:
    # A long request prefilling over [1.0, 3.0].
    long = rec(0, "long", 1.0, [3.0, 3.1])
    # Short A waits through the long prefill and stalls inside it; short B runs clear.
    a = rec(1, "short", 1.5, [2.0, 2.1, 2.9, 3.0])  # gap 2.1->2.9 overlaps and is a stall
    b = rec(2, "short", 4.0, [4.1, 4.2, 4.3, 4.4])
    out = prefill_interference([long, a, b])
    assert out is not None
    assert out["num_long_prefills"] == 1
    assert out["ttft_ms_overlapping_long_prefill"]["n"] == 1
    assert out["ttft_ms_overlapping_long_prefill"]["p50"] == pytest.approx(500)
    assert out["ttft_ms_clear"]["p50"] == pytest.approx(100)
    assert out["gaps_during_long_prefill"] == 3 and out["gaps_otherwise"] == 3
    assert out["p_stall_during_long_prefill"] == pytest.approx(1 / 3)
    assert out["p_stall_otherwise"] == 0


def test_none_without_long_requests() -> None:
    assert prefill_interference([rec(0, "short", 0.0, [0.1, 0.2])]) is None
    assert prefill_interference([rec(0, "long", 0.0, [0.1, 0.2])]) is None


def test_warmup_longs_block_but_warmup_shorts_are_not_judged() -> None:
    long = rec(0, "long", 0.0, [1.0], warmup=True)
    short_w = rec(1, "short", 0.1, [0.9, 1.0], warmup=True)
    short = rec(2, "short", 0.2, [0.9, 1.0])
    out = prefill_interference([long, short_w, short])
    assert out is not None and out["ttft_ms_overlapping_long_prefill"]["n"] == 1
