"""`poise lab`: run the plan's cells (live servers or the simulator) and store what came out.

Output folder:
  lab.yaml                      the manifest: target, sizes, each group's configs, workload and
                                record paths, the tuning run, and (written by the report)
                                which questions this run can answer and why not
  <group>/records/<config>.yaml bench experiment records (+ .requests.jsonl), one per config
  tune/tune.json                the tuning run (``poise tune``'s record)
  report.md, plots/             the answers (``seven_report``)

Live runs go through ``poise sweep``'s machinery (a fresh server per config, resumable cell
store under each group's folder); simulated runs through ``poise simulate``'s bridge.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from poise.lab.seven_plan import QUESTIONS, Group, LabPlan
from poise.lab.store import safe_name

logger = logging.getLogger(__name__)

MANIFEST = "lab.yaml"


@dataclass
class SimTarget:
    """The simulator's cost model (``poise simulate``'s) and prompt-length counter."""

    cost_model: Any
    lengths: Any


def record_path(out: Path, group: str, config: str) -> Path:
    return out / group / "records" / f"{safe_name(config)}.yaml"


# The open-loop batching cells run at this fraction of the requests per second continuous
# batching served in the closed loop: the engine idles between arrivals.
OPEN_LOOP_FRACTION = 0.25


def open_loop_group(group: Group, out: Path) -> Group | None:
    """``batching-open`` with its rate set from the closed-loop continuous record (None when
    that record is not there yet)."""
    from poise.bench.record import ExperimentRecord

    path = record_path(out, "batching", "continuous")
    if not path.exists():
        return None
    cells = ExperimentRecord.load(path).cells
    rps = cells[0].metrics.get("overall", {}).get("requests_per_s") if cells else None
    if not rps:
        return None
    rate = float(f"{rps * OPEN_LOOP_FRACTION:.3g}")
    note = (
        f"Poisson arrivals at {rate:g} req/s, {OPEN_LOOP_FRACTION:g} x the {rps:.3g} req/s "
        "continuous batching served in the closed loop"
    )
    return replace(group, workload=replace(group.workload, request_rate=(rate,)), note=note)


def _run_group_live(group: Group, out: Path, model: str | None, env: dict[str, str]) -> None:
    from poise.lab.sweep import run_sweep, spec_from_dict

    specs = [
        spec_from_dict({"name": n, "model": model, "args": a}, n, model, env)
        for n, a in group.configs.items()
    ]
    run_sweep(specs, group.workload, out / group.name, plots=False)


def _run_group_sim(group: Group, out: Path, sim: SimTarget) -> None:
    from poise.bench.bench_config import BenchConfig
    from poise.config import EngineConfig
    from poise.lab.sim_bridge import simulate_matrix

    cfg = BenchConfig.for_workload(
        group.workload, base_url="simulated://", model=sim.cost_model.name, scrape=False
    )
    cost = sim.cost_model
    if group.sim_acceptance_rate is not None and cost.spec_acceptance_rate is None:
        cost = replace(cost, spec_acceptance_rate=group.sim_acceptance_rate)
    for name, args in group.configs.items():
        record = simulate_matrix(cfg, EngineConfig.from_kwargs(**args), cost, sim.lengths)
        record.provenance["label"] = name
        record.save(record_path(out, group.name, name))


def _run_tune(
    plan: LabPlan, out: Path, model: str | None, env: dict[str, str], sim: SimTarget | None
) -> dict[str, Any]:
    from poise.lab.live import LiveProbe, SimProbe
    from poise.lab.managed_server import ServerSpec
    from poise.lab.tune import Tuner, TuneSettings

    t = plan.tune
    cell = t.workload.cells()[0]
    fixed = dict(t.base_args)
    probe: Any
    if sim is not None:
        probe = SimProbe(fixed, t.workload, cell, sim.cost_model, sim.lengths)
    else:
        spec = ServerSpec(name="tune", model=model, args=fixed, env=env)
        probe = LiveProbe(spec, t.workload, cell, out / "tune")
    settings = TuneSettings(
        t.slo_ttft_p95_ms,
        t.slo_tpot_p50_ms,
        budgets=t.budgets,
        seqs=t.seqs,
        max_probes=t.max_probes,
    )
    result = Tuner(probe, settings, fixed).run()
    record = result.to_dict()
    record["workload"] = asdict(t.workload)
    record["fixed_args"] = fixed
    path = out / "tune" / "tune.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str), encoding="utf-8")
    return record


def run_lab(
    plan: LabPlan,
    out_dir: str | Path,
    *,
    model: str | None = None,
    env: dict[str, str] | None = None,
    sim: SimTarget | None = None,
    groups: tuple[str, ...] | None = None,
    command: str | None = None,
    say: Callable[[str], None] = print,
) -> Path:
    """Run the plan's groups (all, or those named) and the tuning; write the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    wanted = set(groups) if groups else {g.name for g in plan.groups} | {"tune"}
    timings: dict[str, float] = {}
    resolved: dict[str, Group] = {}
    for group in plan.groups:
        if group.name == "batching-open":
            group = open_loop_group(group, out) or group
        resolved[group.name] = group
        if group.name not in wanted:
            continue
        if group.name == "batching-open" and group.workload.request_rate[0] == math.inf:
            say("lab: batching-open skipped: no closed-loop continuous record to set its rate")
            continue
        say(
            f"lab: {group.name} (Q{', Q'.join(map(str, group.questions))}): "
            f"{', '.join(group.configs)}"
        )
        t1 = time.perf_counter()
        if sim is not None:
            _run_group_sim(group, out, sim)
        else:
            _run_group_live(group, out, model, env or {})
        timings[group.name] = round(time.perf_counter() - t1, 1)
    if "tune" in wanted:
        say("lab: tune (Q7)")
        t1 = time.perf_counter()
        _run_tune(plan, out, model, env or {}, sim)
        timings["tune"] = round(time.perf_counter() - t1, 1)
    manifest: dict[str, Any] = {
        "lab": "the seed lab's seven questions (doc 004)",
        "target": plan.target,
        "simulated": sim is not None,
        "cost_model": sim.cost_model.describe() if sim is not None else None,
        "model": model or ("default (embedded SmolLM2-135M-Instruct)" if sim is None else None),
        "scale": plan.scale,
        "command": command,
        "started_at": started,
        "wall_s": round(time.perf_counter() - t0, 1),
        "group_wall_s": timings,
        "questions": {f"Q{k}": v for k, v in QUESTIONS.items()},
        "groups": {
            g.name: {
                "questions": list(g.questions),
                "note": g.note,
                "workload": json.loads(json.dumps(asdict(g.workload), default=str)),
                "configs": g.configs,
                "records": {
                    n: str(record_path(out, g.name, n).relative_to(out)) for n in g.configs
                },
            }
            for g in resolved.values()
        },
        "tune": {
            "slo_ttft_p95_ms": plan.tune.slo_ttft_p95_ms,
            "slo_tpot_p50_ms": plan.tune.slo_tpot_p50_ms,
            "record": "tune/tune.json",
        },
    }
    path = out / MANIFEST
    old = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    if old and groups:  # a partial re-run adds to the run it completes
        manifest["group_wall_s"] = {**old.get("group_wall_s", {}), **timings}
        manifest["wall_s"] = round(sum(manifest["group_wall_s"].values()), 1)
        manifest["started_at"] = old.get("started_at", started)
        manifest["command"] = f"{old.get('command')}; {command}"
    path.write_text(
        yaml.safe_dump(manifest, sort_keys=False, allow_unicode=True, width=100), encoding="utf-8"
    )
    return path
