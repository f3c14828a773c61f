"""One measured cell as flat numbers: what the tuner decides on and the sweep tabulates.

``CellMetrics`` is filled from a bench cell record (``from_bench``), a simulator result or a
mock. Invariants: latencies are milliseconds, throughput is output tokens per second over the
measurement window, ``kv_usage_peak`` is a fraction in [0, 1]; a value the source did not
measure stays None (never an invented zero), and decisions treat None as "unknown".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class CellMetrics:
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    tpot_p50_ms: float | None = None
    e2e_p95_ms: float | None = None
    queue_p95_ms: float | None = None
    output_tokens_per_s: float | None = None
    kv_usage_peak: float | None = None
    preemptions: int | None = None
    waiting_mean: float | None = None
    num_requests: int = 0
    num_errors: int = 0
    # Per request class (e.g. "short", "long"): TTFT p95 in ms.
    class_ttft_p95_ms: dict[str, float] = field(default_factory=dict)
    class_ttft_p50_ms: dict[str, float] = field(default_factory=dict)
    valid: bool = True
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CellMetrics:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_bench(cls, cell: dict[str, Any]) -> CellMetrics:
        """From one cell of a bench record: ``{"metrics": cell_metrics(...), "server": ...}``
        or ``cell_metrics(...)`` itself, with server metrics optional (see poise/bench)."""
        m = cell.get("metrics", cell)
        overall = m.get("overall", {})
        server = cell.get("server") or m.get("server") or {}
        classes = m.get("classes", {}) or {}
        health = cell.get("client_health") or {}
        return cls(
            ttft_p50_ms=_get(overall, "ttft_ms", "p50"),
            ttft_p95_ms=_get(overall, "ttft_ms", "p95"),
            tpot_p50_ms=_get(overall, "tpot_ms", "p50"),
            e2e_p95_ms=_get(overall, "e2e_ms", "p95"),
            queue_p95_ms=_get(overall, "queue_ms", "p95"),
            # The bench record's own definition (and its plots'): measured requests' tokens
            # over the measurement window.
            output_tokens_per_s=_num(overall.get("output_tokens_per_s")),
            kv_usage_peak=_get(server, "kv_usage", "peak"),
            preemptions=_int(server.get("preemptions")),
            waiting_mean=_get(server, "waiting", "mean"),
            num_requests=int(overall.get("num_requests", 0) or 0),
            num_errors=int(overall.get("num_errors", 0) or 0)
            + int(overall.get("num_timeouts", 0) or 0),
            class_ttft_p95_ms=_per_class(classes, "p95"),
            class_ttft_p50_ms=_per_class(classes, "p50"),
            valid=bool(health.get("valid", True)),
            note="; ".join(health.get("invalid_reasons", []) or []),
        )


def _num(v: Any) -> float | None:
    if v is None:
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _int(v: Any) -> int | None:
    x = _num(v)
    return None if x is None else int(round(x))


def _get(d: dict[str, Any], key: str, sub: str) -> float | None:
    inner = d.get(key)
    return _num(inner.get(sub)) if isinstance(inner, dict) else None


def _per_class(classes: dict[str, Any], q: str) -> dict[str, float]:
    out = {}
    for name, group in classes.items():
        v = _get(group, "ttft_ms", q)
        if v is not None:
            out[name] = v
    return out


def fmt_ms(v: float | None) -> str:
    """Human latency: '850 ms', '1.9 s', '-' when unknown."""
    if v is None:
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.0f} ms"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f} %"


def rel_change(new: float | None, old: float | None) -> float | None:
    """(new - old) / old, None when unknown or old is 0."""
    if new is None or old is None or old == 0:
        return None
    return (new - old) / old
