"""The sweep's combined report: ``report.md`` (a table per cell comparing configs, the seed's
questions answered with this run's numbers), one bench record per config
(``records/<config>.yaml``, readable by ``poise bench plot``) and the bench plots comparing
configs (``plots/``: TTFT p95 vs throughput per config, CDFs, a timeline, report.html).

Everything is rebuilt from the cell store, so a resumed sweep reports old and new cells alike.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from poise.bench.bench_config import CellSpec, WorkloadSpec
from poise.lab.cell_metrics import CellMetrics, fmt_ms, fmt_pct, rel_change
from poise.lab.store import CellStore, safe_name
from poise.lab.sweep_questions import answer_questions
from poise.lab.tune_report import table

if TYPE_CHECKING:
    from poise.lab.sweep import SweepResult

logger = logging.getLogger(__name__)

Grid = dict[str, dict[str, CellMetrics]]  # config -> cell label -> metrics

CELL_HEADER = (
    "config",
    "TTFT p50",
    "TTFT p95",
    "short TTFT p95",
    "long TTFT p95",
    "TPOT p50",
    "E2E p95",
    "out tok/s",
    "KV peak",
    "preempt",
    "waiting",
    "errors",
)


def collect(result: SweepResult, store: CellStore) -> tuple[Grid, dict[str, list[dict[str, Any]]]]:
    """(metrics grid, stored entries per config in cell order)."""
    from poise.lab.sweep import fingerprint

    grid: Grid = {}
    entries: dict[str, list[dict[str, Any]]] = {}
    for spec in result.specs:
        fp = fingerprint(spec, result.workload)
        for cell in result.workload.cells():
            entry = store.load(spec.name, cell.label, fp)
            if entry is None:
                continue
            grid.setdefault(spec.name, {})[cell.label] = CellMetrics.from_bench(entry["result"])
            entries.setdefault(spec.name, []).append(entry)
    return grid, entries


def cell_row(name: str, m: CellMetrics) -> tuple[str, ...]:
    return (
        name,
        fmt_ms(m.ttft_p50_ms),
        fmt_ms(m.ttft_p95_ms),
        fmt_ms(m.class_ttft_p95_ms.get("short")),
        fmt_ms(m.class_ttft_p95_ms.get("long")),
        fmt_ms(m.tpot_p50_ms),
        fmt_ms(m.e2e_p95_ms),
        "-" if m.output_tokens_per_s is None else f"{m.output_tokens_per_s:.1f}",
        fmt_pct(m.kv_usage_peak),
        "-" if m.preemptions is None else str(m.preemptions),
        "-" if m.waiting_mean is None else f"{m.waiting_mean:.1f}",
        str(m.num_errors),
    )


def build_records(
    result: SweepResult, entries: dict[str, list[dict[str, Any]]]
) -> list[tuple[str, Any]]:
    """One bench ExperimentRecord per config (saved under records/), for the bench plots."""
    from poise.bench.record import CellResult, ExperimentRecord
    from poise.bench.stats import RequestRecord

    named = []
    for spec in result.specs:
        cells = []
        for entry in entries.get(spec.name, []):
            cell = CellResult.from_dict(entry["result"])
            cell.records = [RequestRecord.from_dict(r) for r in entry.get("records", [])]
            cells.append(cell)
        if not cells:
            continue
        rec = ExperimentRecord(
            experiment={
                "model": spec.model or "default",
                "engine": spec.engine,
                "server_args": dict(spec.args),
                "command": spec.command,
                "workload": result.workload.fingerprint(),
            },
            cells=cells,
            provenance={"label": spec.name, "tool_version": "poise sweep"},
        )
        rec.save(result.out_dir / "records" / f"{safe_name(spec.name)}.yaml")
        named.append((spec.name, rec))
    return named


def write_plots(
    named: list[tuple[str, Any]], out: Path, slo_ttft_ms: float | None
) -> dict[str, Path]:
    if not named:
        return {}
    try:
        from poise.bench.plot import write_report

        return dict(write_report(named, out, slo_ttft_ms=slo_ttft_ms))
    except Exception as exc:  # plots are a view; the tables and records stand without them
        logger.warning("plots failed: %s", exc)
        return {}


def write_sweep_report(
    result: SweepResult,
    store: CellStore,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    plots: bool = True,
) -> Path:
    grid, entries = collect(result, store)
    named = build_records(result, entries)
    if plots:
        result.plots = write_plots(named, result.out_dir / "plots", slo_ttft_ms)
    lines = ["# poise sweep report", ""]
    lines += _configs_section(result)
    lines += _cells_section(result, grid, Slo(slo_ttft_ms, slo_tpot_ms))
    lines += answer_questions(result, grid)
    if result.plots:
        lines += ["## Plots", ""]
        lines += [f"- {k}: `{p.relative_to(result.out_dir)}`" for k, p in result.plots.items()]
        lines.append("")
    path = result.out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    result.report_path = path
    return path


def _workload_text(w: WorkloadSpec) -> str:
    if w.classes:
        mix = "classes " + ", ".join(f"{c.name} (weight {c.weight:g})" for c in w.classes)
    elif w.jsonl is not None:
        mix = f"prompts from {w.jsonl}"
    else:
        mix = f"long-prompt ratio {list(w.long_ratio)}, long prompt = seed line x {w.long_repeat}"
    loads = "; ".join(
        dict.fromkeys(CellSpec(c.concurrency, c.request_rate).describe for c in w.cells())
    )
    return (
        f"Workload: {loads}; {mix}; max_tokens {w.max_tokens}, measured requests per cell "
        f"{w.num_requests or 'bench default'}."
    )


def _configs_section(result: SweepResult) -> list[str]:
    out = [
        _workload_text(result.workload),
        "",
        "## Configs",
        "",
    ]
    by_name = {o.name: o for o in result.outcomes}
    for spec in result.specs:
        o = by_name.get(spec.name)
        how = spec.command or " ".join(f"{k}={v}" for k, v in spec.args.items())
        status = ""
        if o is not None:
            status = f" (measured {len(o.measured)}, reused {len(o.reused)}"
            status += f", FAILED: {o.error})" if o.error else ")"
        out.append(f"- **{spec.name}**: {how}{status}")
    return out + [""]


class Slo(NamedTuple):
    ttft_p95_ms: float | None
    tpot_p50_ms: float | None

    def met(self, m: CellMetrics) -> bool:
        ttft, tpot = self.ttft_p95_ms, self.tpot_p50_ms
        return (ttft is None or (m.ttft_p95_ms or 0.0) <= ttft) and (
            tpot is None or (m.tpot_p50_ms is not None and m.tpot_p50_ms <= tpot)
        )

    def text(self) -> str:
        parts = [f"TTFT p95 <= {fmt_ms(self.ttft_p95_ms)}"] if self.ttft_p95_ms else []
        parts += [f"TPOT p50 <= {fmt_ms(self.tpot_p50_ms)}"] if self.tpot_p50_ms else []
        return ", ".join(parts)


def _cells_section(result: SweepResult, grid: Grid, slo: Slo) -> list[str]:
    out = ["## Results per cell", ""]
    for cell in result.workload.cells():
        rows = [
            (n, grid[n][cell.label])
            for n in (s.name for s in result.specs)
            if cell.label in grid.get(n, {})
        ]
        out.append(f"### {cell.label} ({cell.describe})")
        out.append("")
        if not rows:
            out += ["(not measured)", ""]
            continue
        out += [table(CELL_HEADER, [cell_row(n, m) for n, m in rows]), ""]
        out += _picks(rows, slo) + [""]
    return out


def _picks(rows: list[tuple[str, CellMetrics]], slo: Slo) -> list[str]:
    ok = [
        (n, m)
        for n, m in rows
        if m.ttft_p95_ms is not None
        and m.output_tokens_per_s is not None
        and not m.num_errors
        and slo.met(m)
    ]
    if not ok:
        return [f"No config meets {slo.text()} here."] if slo.text() else []
    thr = max(ok, key=lambda nm: nm[1].output_tokens_per_s or 0.0)
    lat = min(ok, key=lambda nm: nm[1].ttft_p95_ms or 0.0)
    within = f" within {slo.text()}" if slo.text() else ""
    gap = rel_change(lat[1].output_tokens_per_s, thr[1].output_tokens_per_s)
    cost = "" if gap is None else f" ({gap * 100:+.0f} % throughput)"
    return [
        f"Throughput-first{within}: **{thr[0]}** ({thr[1].output_tokens_per_s:.1f} tok/s, "
        f"TTFT p95 {fmt_ms(thr[1].ttft_p95_ms)}); latency-first: **{lat[0]}** (TTFT p95 "
        f"{fmt_ms(lat[1].ttft_p95_ms)}){cost}."
    ]
