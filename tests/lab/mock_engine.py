"""A scripted engine for tuner tests: TTFT p95, TPOT, throughput and KV usage are known,
smooth functions of the token budget, the request cap and the policy, under a fixed closed-loop
client concurrency. ``best_by_brute_force`` is the ground truth the tuner must find."""

from __future__ import annotations

import itertools
import math

from poise.lab.cell_metrics import CellMetrics
from poise.lab.probe import Candidate

CLIENT_CONCURRENCY = 32


def mock_metrics(c: Candidate) -> CellMetrics:
    b, s = c.max_num_batched_tokens, c.max_num_seqs
    active = min(s, CLIENT_CONCURRENCY)
    steps = math.log2(b / 512)  # 0 for 512 ... 5 for 16384
    # Bigger budgets: more prefill per step, diminishing returns in throughput, longer steps
    # (TTFT p95 and TPOT rise). More active requests: more throughput, less time waiting for
    # a slot, but every step carries more decodes.
    gain = 1.0 + 0.25 * steps - 0.025 * steps**2
    tpot = 20.0 + 1.5 * active + 4.0 * steps
    thr = active * 1000.0 / (20.0 + 1.5 * active) * gain
    queue = max(0, CLIENT_CONCURRENCY - active) / active * 150.0
    ttft = 120.0 + 60.0 * steps**1.3 + 12.0 * active + queue
    if c.scheduling_policy == "prefill_first":
        ttft *= 0.8
        tpot *= 1.3
        thr *= 0.95
    return CellMetrics(
        ttft_p50_ms=ttft * 0.6,
        ttft_p95_ms=ttft,
        tpot_p50_ms=tpot,
        e2e_p95_ms=ttft + 160 * tpot,
        output_tokens_per_s=thr,
        kv_usage_peak=min(1.0, s / 48.0),
        preemptions=0 if s <= 48 else 3,
        num_requests=64,
    )


def best_by_brute_force(
    budgets: tuple[int, ...],
    seqs: tuple[int, ...],
    slo_ttft: float,
    slo_tpot: float | None = None,
    kv_headroom: float = 0.9,
) -> tuple[Candidate | None, Candidate | None]:
    """(throughput-first, latency-first) over the whole grid, or (None, None)."""
    ok = []
    for b, s, p in itertools.product(budgets, seqs, ("fifo", "prefill_first")):
        c = Candidate(b, s, p)
        m = mock_metrics(c)
        assert m.ttft_p95_ms is not None and m.output_tokens_per_s is not None
        fits = m.ttft_p95_ms <= slo_ttft and (slo_tpot is None or (m.tpot_p50_ms or 0) <= slo_tpot)
        stable = not m.preemptions and (m.kv_usage_peak or 0) < kv_headroom
        if fits and stable:
            ok.append((c, m))
    if not ok:
        return None, None
    thr = max(ok, key=lambda cm: cm[1].output_tokens_per_s or 0)[0]
    lat = min(ok, key=lambda cm: cm[1].ttft_p95_ms or 0)[0]
    return thr, lat
