"""What a tuning run is and what it found: ``TuneSettings`` (the SLO, the ladders, the
thresholds), ``Evidence`` (one probe and the decision it led to) and ``TuneResult`` (all the
evidence, the decisions and the answers), with their JSON form for ``tune.json``. The
procedure that fills them is ``poise.lab.tune.Tuner``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from poise.lab.cell_metrics import CellMetrics
from poise.lab.probe import Candidate

DEFAULT_BUDGETS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_SEQS = (4, 8, 16, 32, 64)


@dataclass(frozen=True)
class TuneSettings:
    slo_ttft_p95_ms: float
    slo_tpot_p50_ms: float | None = None
    budgets: tuple[int, ...] = DEFAULT_BUDGETS  # ladder, ascending; baseline = first
    seqs: tuple[int, ...] = DEFAULT_SEQS  # ladder, ascending; start = first
    policy: str = "fifo"
    try_policies: bool = True
    trade: bool = True
    latency_search: bool = True
    min_gain: float = 0.03  # a throughput change below this is "no gain"
    tail_tolerance: float = 0.10  # TTFT p95 growth above this is "the tail worsens"
    kv_headroom: float = 0.90  # peak KV usage at or above this: no headroom left
    max_probes: int = 30
    # The SLO-aware scheduling phase (lab/tune_slo.py): policy slo with classes, the first
    # class's share ladder, and the controller's TPOT target as fractions of the TPOT SLO.
    slo_scheduling: bool = True
    class_shares: tuple[float, ...] = (0.5, 0.7, 0.9)
    controller_targets: tuple[float, ...] = (0.6, 0.8, 1.0)

    def __post_init__(self) -> None:
        if self.slo_ttft_p95_ms <= 0:
            raise ValueError("slo_ttft_p95_ms must be > 0")
        for name in ("budgets", "seqs"):
            ladder = getattr(self, name)
            if not ladder or list(ladder) != sorted(set(ladder)) or ladder[0] < 1:
                raise ValueError(f"{name}: a non-empty ascending ladder of positive ints")


@dataclass
class Evidence:
    """One probe: what was tried, in which phase, what came back and what was decided."""

    index: int
    phase: str
    candidate: Candidate
    metrics: CellMetrics | None
    meets_slo: bool
    decision: str = ""
    error: str | None = None


@dataclass
class TuneResult:
    settings: TuneSettings
    evidence: list[Evidence] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    throughput_first: Evidence | None = None
    latency_first: Evidence | None = None
    closest: Evidence | None = None  # lowest TTFT p95 overall, when nothing meets the SLO

    @property
    def met(self) -> bool:
        return self.throughput_first is not None

    def to_dict(self) -> dict[str, Any]:
        def ev(e: Evidence | None) -> dict[str, Any] | None:
            if e is None:
                return None
            return {
                "index": e.index,
                "phase": e.phase,
                "args": e.candidate.to_args(),
                "metrics": e.metrics.to_dict() if e.metrics else None,
                "meets_slo": e.meets_slo,
                "decision": e.decision,
                "error": e.error,
            }

        return {
            "slo": {
                "ttft_p95_ms": self.settings.slo_ttft_p95_ms,
                "tpot_p50_ms": self.settings.slo_tpot_p50_ms,
            },
            "met": self.met,
            "throughput_first": ev(self.throughput_first),
            "latency_first": ev(self.latency_first),
            "closest": ev(self.closest),
            "decisions": list(self.decisions),
            "evidence": [ev(e) for e in self.evidence],
        }
