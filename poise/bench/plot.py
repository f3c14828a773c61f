"""Plots from experiment records: TTFT p95 vs output throughput (curves, Pareto frontier, SLO
line), CDFs of TTFT/TPOT per class, a timeline of one cell (request bars over the server's
KV usage, running and waiting), and a self-contained HTML report with the PNGs inlined.

matplotlib with the Agg backend only; everything is rebuilt from records (YAML + JSONL).
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from poise.bench.record import TEMPLATE_METRICS, CellResult, ExperimentRecord  # noqa: E402
from poise.bench.stats import derive  # noqa: E402

Named = tuple[str, ExperimentRecord]


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (throughput, ttft) not dominated by another with more throughput and less
    TTFT; sorted by throughput."""
    front = []
    best = float("inf")
    for x, y in sorted(points, key=lambda p: (-p[0], p[1])):
        if y < best:
            front.append((x, y))
            best = y
    return sorted(front)


def _load_label(cell: CellResult) -> str:
    load = cell.load
    if load.get("mode") == "open":
        return f"r{load.get('request_rate'):g}"
    return f"c{load.get('concurrency')}"


def plot_ttft_vs_throughput(
    records: Sequence[Named], path: Path, slo_ttft_ms: float | None = None
) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5.5))
    # Frontiers compare configs on the same workload: one per long ratio (or class mix).
    by_workload: dict[Any, list[tuple[float, float]]] = {}
    for name, rec in records:
        curves: dict[Any, list[CellResult]] = {}
        for cell in rec.cells:
            curves.setdefault(cell.load.get("long_prompt_ratio"), []).append(cell)
        for ratio, cells in curves.items():
            pts = [
                (
                    c.metrics["overall"]["output_tokens_per_s"],
                    c.metrics["overall"]["ttft_ms"]["p95"],
                    c,
                )
                for c in cells
            ]
            pts = [p for p in pts if p[0] is not None and p[1] is not None]
            if not pts:
                continue
            label = name if ratio is None else f"{name} long={ratio:g}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            for x, y, c in pts:
                ax.annotate(
                    _load_label(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8
                )
            by_workload.setdefault(ratio, []).extend((x, y) for x, y, _ in pts)
    for i, points in enumerate(by_workload.values()):
        front = pareto_front(points)
        # Hollow squares mark frontier points (a one-point frontier has no line to see).
        ax.plot(
            [p[0] for p in front],
            [p[1] for p in front],
            "k--",
            lw=1.5,
            alpha=0.6,
            marker="s",
            markersize=13,
            markerfacecolor="none",
            label="Pareto frontier (per workload)" if i == 0 else None,
        )
    slo = slo_ttft_ms or _slo(records)
    if slo:
        ax.axhline(slo, color="red", ls=":", label=f"TTFT SLO {slo:g} ms")
    ax.set_xlabel("output tokens/s (measurement window)")
    ax.set_ylabel("TTFT p95 (ms)")
    ax.set_title("TTFT p95 vs output throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _slo(records: Sequence[Named]) -> float | None:
    for _, rec in records:
        slo = rec.experiment.get("workload", {}).get("slo_ttft_ms")
        if slo:
            return float(slo)
    return None


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def pick_cell(rec: ExperimentRecord, label: str | None) -> CellResult:
    if label is not None:
        for c in rec.cells:
            if c.label == label:
                return c
        raise ValueError(f"no cell {label!r}; cells: {[c.label for c in rec.cells]}")
    with_records = [c for c in rec.cells if c.records] or rec.cells
    return with_records[-1]  # the heaviest load by construction order


def plot_cdfs(records: Sequence[Named], path: Path, cell_label: str | None = None) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, rec in records:
        cell = pick_cell(rec, cell_label)
        meas = [r for r in cell.records if not r.warmup and r.ok]
        for cls in sorted({r.class_name for r in meas}):
            stats = [derive(r) for r in meas if r.class_name == cls]
            tag = f"{name} {cell.label} {cls}"
            _cdf(axes[0], [s.ttft * 1000 for s in stats if s.ttft is not None], tag)
            _cdf(axes[1], [s.tpot * 1000 for s in stats if s.tpot is not None], tag)
    for ax, what in zip(axes, ("TTFT (ms)", "TPOT (ms)"), strict=True):
        ax.set_xlabel(what)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("Latency CDFs per class")
    return _save(fig, path)


def plot_timeline(
    name: str, rec: ExperimentRecord, path: Path, cell_label: str | None = None
) -> Path:
    cell = pick_cell(rec, cell_label)
    ts = cell.server_timeseries
    fig, axes = plt.subplots(
        3, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [3, 1, 1]}
    )
    colors: dict[str, str] = {}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, r in enumerate(sorted(cell.records, key=lambda r: r.start)):
        color = colors.setdefault(r.class_name, palette[len(colors) % len(palette)])
        first = r.events[0] if r.events else (r.end or r.start)
        last = r.events[-1] if r.events else first
        alpha = 0.35 if r.warmup else 1.0
        # Waiting for the first token (queue + prefill) light; decoding solid; failures red.
        axes[0].barh(row, first - r.start, left=r.start, color=color, alpha=0.3 * alpha, height=0.8)
        axes[0].barh(
            row, last - first, left=first, color=color if r.ok else "red", alpha=alpha, height=0.8
        )
    handles = [Patch(color=color, label=cls) for cls, color in colors.items()]
    handles.append(Patch(color="red", label="failed"))
    axes[0].set_ylabel("request (faded: warmup)")
    axes[0].legend(handles=handles, fontsize=8, loc="upper left")
    axes[0].set_title(f"{name} {cell.label}: requests (light: until first token) and server state")
    t = ts.get("t") or []
    kv = [v * 100 if v is not None else None for v in ts.get("kv_usage") or []]
    if t and any(v is not None for v in kv):
        axes[1].plot(t, kv, drawstyle="steps-post", color="purple")
    axes[1].set_ylabel("KV usage %")
    for key, style in (("running", "-"), ("waiting", "--")):
        vals = ts.get(key) or []
        if t and any(v is not None for v in vals):
            axes[2].plot(t, vals, style, drawstyle="steps-post", label=key)
    if axes[2].get_legend_handles_labels()[0]:
        axes[2].legend(fontsize=8)
    axes[2].set_ylabel("requests")
    axes[2].set_xlabel("seconds since cell start")
    for ax in axes:
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _summary_html(records: Sequence[Named]) -> str:
    keys = [k for k in TEMPLATE_METRICS if k not in ("kv_cache_usage", "running_waiting")]
    head = "".join(f"<th>{k}</th>" for k in ["record", "cell", *keys, "kv peak", "valid"])
    rows = []
    for name, rec in records:
        for cell in rec.cells:
            tpl = cell.template()
            vals = [tpl[k] for k in keys] + [tpl["kv_cache_usage"].get("peak")]
            cells = "".join(f"<td>{_fmt(v)}</td>" for v in vals)
            valid = cell.client_health.get("valid", True)
            rows.append(
                f"<tr><td>{html.escape(name)}</td><td>{html.escape(cell.label)}</td>{cells}"
                f"<td>{'ok' if valid else 'INVALID'}</td></tr>"
            )
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 1 else f"{v:.3f}"
    return html.escape("-" if v is None else str(v))


def write_report(
    records: Sequence[Named],
    out_dir: str | Path,
    cell_label: str | None = None,
    slo_ttft_ms: float | None = None,
) -> dict[str, Path]:
    """All plots as PNG plus ``report.html`` (PNGs embedded as base64) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "ttft_vs_throughput": plot_ttft_vs_throughput(
            records, out / "ttft_vs_throughput.png", slo_ttft_ms
        ),
        "cdf": plot_cdfs(records, out / "cdf.png", cell_label),
    }
    name, rec = records[0]
    files["timeline"] = plot_timeline(name, rec, out / "timeline.png", cell_label)
    imgs = "".join(
        f'<h2>{k}</h2><img alt="{k}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}">'
        for k, p in files.items()
    )
    doc = (
        "<!doctype html><html><head><meta charset='utf-8'><title>poise bench report</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}img{max-width:100%}</style>"
        f"</head><body><h1>poise bench report</h1>{_summary_html(records)}{imgs}</body></html>"
    )
    files["html"] = out / "report.html"
    files["html"].write_text(doc, encoding="utf-8")
    return files
