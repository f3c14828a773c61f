"""The report of benchmarks/scale_out.py: measured against simulated per cell, the relay
model against the relay CPU measured over each cell, the routers against round robin, the
verdict; written as report.md and cells.json next to the run's logs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from scale_out_measure import summarize


def report(cells: list[dict[str, Any]], out: Path, tolerance: float, profile_path: Path) -> bool:
    lines = [
        f"profile {profile_path}; simulation: median of seeds; ratio = simulated / measured; "
        "sim on shared cores (the prediction), and with a core per replica (for comparison)",
        "",
        "| replicas | router | requests | prefix-cache hit real / sim | TTFT p50 ms real / sim "
        "| TTFT p95 ms real / sim | p95 ratio | output tok/s real / sim | tok/s ratio "
        "| own cores: p95, tok/s ratio | engine share (sim) "
        "| calibration (time scale, overhead ms) | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for c in cells:
        s, own = c["sim"], c["sim_own_cores"]
        p95, tps = s["ttft_p95_ms"] / c["ttft_p95_ms"], s["tok_s"] / c["tok_s"]
        if c["replicas"] == 2:
            ok = ok and abs(p95 - 1) <= tolerance and abs(tps - 1) <= tolerance
        k = s["calibration"]
        lines.append(
            f"| {c['replicas']} | {c['policy'] if c['replicas'] > 1 else '- (plain server)'} "
            f"| {len(c['records'])} | {c['hit']:.3f} / {s['hit']:.3f} "
            f"| {c['ttft_p50_ms']:.0f} / {s['ttft_p50_ms']:.0f} "
            f"| {c['ttft_p95_ms']:.0f} / {s['ttft_p95_ms']:.0f} | {p95:.2f} "
            f"| {c['tok_s']:.1f} / {s['tok_s']:.1f} | {tps:.2f} "
            f"| {own['ttft_p95_ms'] / c['ttft_p95_ms']:.2f}, {own['tok_s'] / c['tok_s']:.2f} "
            f"| {s['engine_share']:.2f} "
            f"| {k['time_scale']:.2f}, {1000 * k['request_overhead_s']:.0f} "
            f"| {c['loadavg'][0]:.1f}-{c['loadavg'][1]:.1f} |"
        )
    lines += [
        "",
        "The relay (measured before each cell: idle window, c=1 cell) and, as a check of "
        "its model, the relay CPU measured over the cell against the model at the cell's "
        "measured request and token rates:",
        "",
        "| replicas | router | background cores | relay ms / request "
        "| relay ms / token (c=1) | relay ms / token (used) "
        "| cell: relay cores measured / modelled | cell: engine CPU s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        cpu, used = c["shared_cpu"], c["cell_cpu"]
        span = summarize(c["records"])["span_s"]
        modelled = cpu.relay_cores(len(c["records"]) / span, c["tok_s"])
        lines.append(
            f"| {c['replicas']} | {c['policy']} | {cpu.background_cores:.3f} "
            f"| {1000 * cpu.relay_s_per_request:.1f} | {1000 * c['relay_s_per_token_c1']:.2f} "
            f"| {1000 * cpu.relay_s_per_token:.2f} "
            f"| {used['other_s'] / used['wall_s']:.2f} / {modelled:.2f} "
            f"| {used['engine_s']:.1f} |"
        )
    rr = next((c for c in cells if c["replicas"] == 2 and c["policy"] == "round_robin"), None)
    if rr is not None:
        lines += [
            "",
            "| 2 replicas, router | hit | TTFT p95 / round_robin | tok/s / round_robin |",
            "|---|---|---|---|",
        ]
        for c in (c for c in cells if c["replicas"] == 2):
            lines.append(
                f"| {c['policy']} | {c['hit']:.3f} | "
                f"{c['ttft_p95_ms'] / rr['ttft_p95_ms']:.2f} | "
                f"{c['tok_s'] / rr['tok_s']:.2f} |"
            )
    lines += [
        "",
        f"2-replica cells within ±{tolerance:.0%} (TTFT p95 and tok/s): "
        f"**{'PASS' if ok else 'FAIL'}**",
    ]
    md = "\n".join(lines)
    print(md, flush=True)
    (out / "report.md").write_text(md + "\n")
    dump = [
        {k: v for k, v in c.items() if k not in ("records", "calibration", "reqs")}
        | {
            "shared_cpu": c["shared_cpu"].describe(),
            "records": [r.to_dict() for r in c["records"]],
            "calibration": [r.to_dict() for r in c["calibration"]],
            "workload": [dataclasses.asdict(r) for r in c["reqs"]],
        }
        for c in cells
    ]
    (out / "cells.json").write_text(json.dumps(dump, indent=1, default=str))
    return ok
