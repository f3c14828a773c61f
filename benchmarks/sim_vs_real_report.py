"""The comparison and report of benchmarks/sim_vs_real.py: simulated against pooled real
metrics per cell, and the markdown tables."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import yaml

from poise.bench.record import ExperimentRecord
from poise.lab.calibration import pooled_metrics

METRICS = ("p50_ttft_ms", "p95_ttft_ms", "output_tokens_per_s")


def rel(sim: float, real: float) -> float | None:
    return (sim - real) / real if real else None


def compare(
    real: dict[str, Any], sim: dict[str, Any], tolerance: float
) -> tuple[dict[str, Any], bool]:
    row: dict[str, Any] = {}
    ok = True
    for m in METRICS:
        err = rel(sim[m], real[m])
        lo = min(r[m] for r in real["rounds"])
        hi = max(r[m] for r in real["rounds"])
        row[m] = {"real": real[m], "sim": sim[m], "rel_error": err, "real_rounds": [lo, hi]}
        ok = ok and err is not None and abs(err) <= tolerance
    return row, ok


def table(title: str, rows: dict[int, dict[str, Any]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| c | TTFT p50 real / sim (ms) | err | TTFT p95 real / sim (ms) | err "
        "| out tok/s real / sim | err |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, row in rows.items():
        cells = [str(c)]
        for m in METRICS:
            v = row[m]
            cells.append(f"{v['real']:.1f} / {v['sim']:.1f}")
            cells.append("-" if v["rel_error"] is None else f"{v['rel_error'] * 100:+.1f} %")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def band_table(title: str, rows: dict[int, dict[str, Any]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| c | TTFT p50 real / sim median [seed range] (ms) | err | TTFT p95 real / sim "
        "median [range] (ms) | err | out tok/s real / sim median [range] | err |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, row in rows.items():
        cells = [str(c)]
        for m in METRICS:
            v = row[m]
            lo, hi = v["sim_seeds"]
            mark = "" if v["real_in_band"] else " (real outside)"
            cells.append(f"{v['real']:.1f} / {v['sim']:.1f} [{lo:.0f}-{hi:.0f}]{mark}")
            cells.append("-" if v["rel_error"] is None else f"{v['rel_error'] * 100:+.1f} %")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_table(real: dict[int, dict[str, Any]]) -> str:
    """Each round's value against the pooled one: the measurement's own noise."""
    lines = [
        "### the real runs, round by round (pooled value; each round's deviation)",
        "",
        "| c | TTFT p50 | TTFT p95 | out tok/s |",
        "|---|---|---|---|",
    ]
    for c, r in real.items():
        cells = [str(c)]
        for m in METRICS:
            devs = ", ".join(f"{(x[m] / r[m] - 1) * 100:+.0f}" for x in r["rounds"])
            cells.append(f"{r[m]:.1f} ({devs} %)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def by_class(paths: list[Path]) -> dict[str, dict[str, float]]:
    """Per request class: admission (send to response headers: the way in plus the wait for
    the step under way) and TTFT, p50 in ms, over the measured requests of ``paths``."""
    from poise.bench.stats import derive, percentile

    out: dict[str, dict[str, list[float]]] = {}
    for p in paths:
        for r in ExperimentRecord.load(p).cells[0].records:
            if r.warmup or not r.ok:
                continue
            d = out.setdefault(r.class_name, {"header": [], "ttft": []})
            if r.header is not None:
                d["header"].append((r.header - r.start) * 1000)
            ttft = derive(r).ttft
            if ttft is not None:
                d["ttft"].append(ttft * 1000)
    return {
        cls: {k: percentile(v, 50) or float("nan") for k, v in d.items()} | {"n": len(d["ttft"])}
        for cls, d in sorted(out.items())
    }


def class_table(title: str, rows: dict[int, tuple[dict[str, Any], dict[str, Any]]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| c | class | n | admission p50 real / sim (ms) | TTFT p50 real / sim (ms) |",
        "|---|---|---|---|---|",
    ]
    for c, (real, sim) in rows.items():
        for cls, r in real.items():
            s = sim.get(cls, {})
            lines.append(
                f"| {c} | {cls} | {r['n']} | {r['header']:.0f} / {s.get('header', float('nan')):.0f}"
                f" | {r['ttft']:.0f} / {s.get('ttft', float('nan')):.0f} |"
            )
    return "\n".join(lines)


def judge(
    name: str, real: dict[int, Any], by_seed: dict[int, list[list[Path]]], tolerance: float
) -> tuple[dict[str, Any], bool]:
    """One variant against the real cells: seed 0's table and, with several seeds, the median
    over seeds with their range. Returns (report section with its markdown, within tolerance:
    of the median when seeded, else of seed 0)."""
    seeded = {c: [pooled_metrics(paths) for paths in runs] for c, runs in by_seed.items()}
    rows, ok = {}, True
    for c in seeded:
        rows[c], k = compare(real[c], seeded[c][0], tolerance)
        ok = ok and k
    speeds = [
        yaml.safe_load(runs[0][0].read_text())["provenance"].get("simulated_requests_per_wall_s")
        for runs in by_seed.values()
    ]
    section: dict[str, Any] = {
        "rows": rows,
        "within_tolerance": ok,
        "sim_requests_per_wall_s": speeds,
    }
    md = [table(f"{name}, seed 0: {'PASS' if ok else 'FAIL'} at ±{tolerance:.0%}", rows), ""]
    n_seeds = len(next(iter(seeded.values())))
    if n_seeds > 1:
        # The simulator is stochastic (step jitter): its prediction is a distribution. Seed 0
        # above is one draw; the median over seeds is the point estimate, the band says how
        # far one run of this size can fall from it.
        band_rows, ok = {}, True
        for c in seeded:
            med = {m: statistics.median(d[m] for d in seeded[c]) for m in METRICS}
            row, k = compare(real[c], med, tolerance)
            for m in METRICS:
                vals = [d[m] for d in seeded[c]]
                row[m]["sim_seeds"] = [min(vals), max(vals)]
                row[m]["real_in_band"] = min(vals) <= real[c][m] <= max(vals)
            band_rows[c], ok = row, ok and k
        section["seeds"] = {"n": n_seeds, "rows": band_rows, "within_tolerance": ok}
        md += [
            band_table(
                f"{name}, median over {n_seeds} simulator seeds: "
                f"{'PASS' if ok else 'FAIL'} at ±{tolerance:.0%}",
                band_rows,
            ),
            "",
        ]
    section["md"] = md
    return section, ok
