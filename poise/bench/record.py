"""The experiment record: the user's YAML template (experiment: model, gpu, engine, version,
workload, server_args, metrics), extended with a result per cell and per class, the server
time series, client health and provenance. Per-request data goes to a JSONL file beside it.

``build_cell`` takes per-request records computed anywhere (the live client, the simulator)
and produces the same shape; ``kind`` says ``measured`` or ``simulated``.
Invariants: request times in a cell are relative to the cell's start (t=0), the same origin
as its server time series; the YAML is self-describing (schema_version, definitions).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from poise.bench.interference import prefill_interference
from poise.bench.prom import Scrape, summarize_window, timeseries
from poise.bench.stats import SLO, RequestRecord, cell_metrics, client_health

SCHEMA_VERSION = 1
TEMPLATE_METRICS = (
    "p50_ttft_ms",
    "p95_ttft_ms",
    "p50_tpot_ms",
    "p95_e2e_ms",
    "output_tokens_per_s",
    "kv_cache_usage",
    "running_waiting",
    "preemption_count",
)
DEFINITIONS = {
    "ttft": "first token event - request sent (role-only and usage-only events excluded)",
    "tpot": "(e2e - ttft) / (n_out - 1), per request",
    "itl": "per token: each event gap split over the tokens it carries; token-weighted",
    "icl": "raw gap between token events (per chunk)",
    "e2e": "last token event - request sent; e2e_stream ends at the stream's end",
    "n_out": "usage.completion_tokens, else per-event usage sum, else token events",
    "output_tokens_per_s": "sum(n_out of measured ok requests) / window",
    "window": "first measured request sent .. last measured request ended (warmup excluded)",
    "sched_lag": "request sent - intended send time (slot free / scheduled arrival)",
    "kv_cache_usage": "server gauge, fraction 0..1, scrapes inside the window",
    "preemption_count": "server preemption counter delta across the window",
    "spec_decode": "server spec_decode_* counter deltas across the window; acceptance_rate = "
    "accepted / draft tokens, mean_accepted_length = 1 + accepted / drafts (None: no speculation)",
}


@dataclass
class CellResult:
    load: dict[str, Any]
    metrics: dict[str, Any]
    server: dict[str, Any]
    client_health: dict[str, Any]
    server_timeseries: dict[str, list[Any]] = field(default_factory=dict)
    started_at: str | None = None
    num_warmup: int = 0
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        return str(self.load.get("label", ""))

    def template(self) -> dict[str, Any]:
        """The seed template's metrics block for this cell."""
        ov = self.metrics["overall"]
        srv = self.server
        run, wait = srv.get("running") or {}, srv.get("waiting") or {}
        return {
            "concurrency": self.load.get("concurrency"),
            "request_rate": self.load.get("request_rate"),
            "long_prompt_ratio": self.load.get("long_prompt_ratio"),
            "p50_ttft_ms": ov["ttft_ms"]["p50"],
            "p95_ttft_ms": ov["ttft_ms"]["p95"],
            "p50_tpot_ms": ov["tpot_ms"]["p50"],
            "p95_e2e_ms": ov["e2e_ms"]["p95"],
            "output_tokens_per_s": ov["output_tokens_per_s"],
            "kv_cache_usage": srv.get("kv_usage") or {"peak": None, "mean": None},
            "running_waiting": {
                "running_mean": run.get("mean"),
                "running_max": run.get("max"),
                "waiting_mean": wait.get("mean"),
                "waiting_max": wait.get("max"),
            },
            "preemption_count": srv.get("preemptions"),
        }

    def compat_vllm(self) -> dict[str, Any]:
        """The overall numbers under `vllm bench serve` result keys. Caveats: vLLM's "itl" is
        per chunk (our icl); its durations run from dispatch to drain, ours over the window."""
        ov = self.metrics["overall"]
        out: dict[str, Any] = {
            "completed": ov["num_ok"],
            "failed": ov["num_requests"] - ov["num_ok"],
            "total_output_tokens": ov["output_tokens"],
            "total_input_tokens": ov["prompt_tokens"],
            "request_throughput": ov["requests_per_s"],
            "output_throughput": ov["output_tokens_per_s"],
            "duration": self.metrics.get("window_s"),
        }
        for ours, theirs in (
            ("ttft_ms", "ttft"),
            ("tpot_ms", "tpot"),
            ("icl_ms", "itl"),
            ("e2e_ms", "e2el"),
        ):
            summary = ov[ours]
            out[f"mean_{theirs}_ms"] = summary["mean"]
            out[f"median_{theirs}_ms"] = summary["p50"]
            out[f"p99_{theirs}_ms"] = summary["p99"]
        goodput = ov.get("goodput")
        if goodput:
            out["request_goodput"] = goodput["requests_per_s"]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "load": self.load,
            "started_at": self.started_at,
            "num_warmup": self.num_warmup,
            "metrics": self.metrics,
            "server": self.server,
            "client_health": self.client_health,
            "server_timeseries": self.server_timeseries,
            "compat_vllm": self.compat_vllm(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CellResult:
        return cls(
            load=d["load"],
            metrics=d["metrics"],
            server=d.get("server") or {},
            client_health=d.get("client_health") or {},
            server_timeseries=d.get("server_timeseries") or {},
            started_at=d.get("started_at"),
            num_warmup=d.get("num_warmup", 0),
        )


def shift(rec: RequestRecord, t0: float) -> RequestRecord:
    """The record with every time relative to ``t0``."""

    def s(x: float | None) -> float | None:
        return None if x is None else x - t0

    return replace(
        rec,
        start=rec.start - t0,
        intended=s(rec.intended),
        header=s(rec.header),
        end=s(rec.end),
        events=[t - t0 for t in rec.events],
    )


def cell_load(cfg: Any, spec: Any, salt: str | None) -> dict[str, Any]:
    """The record's description of a cell's load (``cfg``: BenchConfig, ``spec``: CellSpec)."""
    return {
        "label": spec.label,
        "mode": "closed" if spec.closed_loop else "open",
        "concurrency": spec.concurrency,
        "request_rate": None if spec.closed_loop else spec.request_rate,
        "burstiness": None if spec.closed_loop else cfg.burstiness,
        "long_prompt_ratio": spec.long_ratio,
        "salt": salt,
    }


def build_cell(
    load: dict[str, Any],
    records: Sequence[RequestRecord],
    *,
    slo: SLO = SLO(),
    include_failures: bool = False,
    scrapes: Sequence[Scrape] = (),
    loop_lags: Sequence[float] = (),
    max_lag_ms: float = 10.0,
    cpu_util: float | None = None,
    t0: float = 0.0,
    started_at: str | None = None,
) -> CellResult:
    """A cell from per-request records (any origin) and optional server scrapes (same clock
    as the records). Times are re-based to ``t0``."""
    recs = [shift(r, t0) for r in records]
    metrics = cell_metrics(recs, slo, include_failures)
    metrics["interference"] = prefill_interference(recs)
    shifted = [replace(s, t=s.t - t0) for s in scrapes]
    w0, w1 = metrics.get("window") or (0.0, 0.0)
    server = summarize_window(shifted, w0, w1) if shifted else {}
    return CellResult(
        load=load,
        metrics=metrics,
        server=server,
        client_health=client_health(recs, loop_lags, max_lag_ms, cpu_util),
        server_timeseries=timeseries(shifted, 0.0) if shifted else {},
        started_at=started_at,
        num_warmup=sum(r.warmup for r in recs),
        records=recs,
    )


@dataclass
class ExperimentRecord:
    experiment: dict[str, Any]  # model, gpu, engine, version, workload, server_args
    cells: list[CellResult]
    provenance: dict[str, Any] = field(default_factory=dict)
    kind: str = "measured"  # or "simulated"
    capabilities: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.provenance.get("label") or self.experiment.get("engine") or "run")

    def to_dict(self) -> dict[str, Any]:
        exp = dict(self.experiment)
        exp["metrics"] = [c.template() for c in self.cells]
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "experiment": exp,
            "results": [c.to_dict() for c in self.cells],
            "capabilities": self.capabilities,
            "provenance": self.provenance,
            "artifacts": self.artifacts,
            "definitions": DEFINITIONS,
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            _clean(self.to_dict()), sort_keys=False, allow_unicode=True, width=100
        )

    @classmethod
    def from_yaml(cls, text: str) -> ExperimentRecord:
        d = yaml.safe_load(text)
        exp = dict(d["experiment"])
        exp.pop("metrics", None)  # derived from the cells
        return cls(
            experiment=exp,
            cells=[CellResult.from_dict(c) for c in d.get("results") or []],
            provenance=d.get("provenance") or {},
            kind=d.get("kind", "measured"),
            capabilities=d.get("capabilities") or {},
            artifacts=d.get("artifacts") or {},
        )

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (YAML) and, when cells hold records, ``<stem>.requests.jsonl``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if any(c.records for c in self.cells):
            jl = path.with_suffix(".requests.jsonl")
            with jl.open("w", encoding="utf-8") as f:
                for i, c in enumerate(self.cells):
                    for r in c.records:
                        f.write(
                            json.dumps({"cell": i, "cell_label": c.label, **r.to_dict()}) + "\n"
                        )
            self.artifacts["requests_jsonl"] = jl.name
        path.write_text(self.to_yaml(), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> ExperimentRecord:
        """Read a record and, when present, its per-request JSONL back into the cells."""
        path = Path(path)
        rec = cls.from_yaml(path.read_text(encoding="utf-8"))
        name = rec.artifacts.get("requests_jsonl")
        jl = path.parent / name if name else None
        if jl is not None and jl.exists():
            for line in jl.read_text(encoding="utf-8").splitlines():
                d = json.loads(line)
                i = d.pop("cell")
                if 0 <= i < len(rec.cells):
                    rec.cells[i].records.append(RequestRecord.from_dict(d))
        return rec


def _clean(x: Any) -> Any:
    """YAML-safe: tuples to lists, NaN to None (inf stays, as .inf), floats rounded to
    microsecond-ish precision so records stay readable and diffable."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return None if math.isnan(x) else (x if math.isinf(x) else round(x, 4))
    return x
