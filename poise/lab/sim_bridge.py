"""The bench <-> simulator bridge: bench cells run through ``poise.sim.simulate_cell``.

``simulate_bench_cell`` turns one bench ``CellSpec`` into a bench ``CellResult`` (the same record
shape as a live cell, server view sampled from the simulated timeline); ``simulate_matrix`` does
a whole ``BenchConfig``. It lives in lab because it joins bench and sim, which must not import
each other; `poise simulate` and `poise tune --simulate` both call it.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from poise.bench.record import cell_load

SIM_SALT = "sim00000"  # fixed, so simulated runs are reproducible; same length as bench's


def _records(result: Any, timeout_s: float) -> list[Any]:
    """Bench records of the simulated requests. A request slower than ``timeout_s`` is recorded
    as the client sees it (timed out, the tokens before the deadline); the simulated engine
    still finished it, where a real server would have aborted it on the disconnect."""
    from poise.bench.stats import RequestRecord

    out = []
    for r in result.requests:
        deadline = r.sent + timeout_s
        times = [t for t in r.token_times if t <= deadline]
        late = len(times) < len(r.token_times) or (r.finished or 0.0) > deadline
        rec = RequestRecord.from_token_times(
            r.index,
            r.class_name,
            r.sent,
            times,
            intended=r.intended,
            max_tokens=r.max_tokens,
            usage_prompt_tokens=r.num_prompt_tokens,
            ok=r.ok and not late,
            error="timeout" if late else r.error,
            warmup=r.warmup,
            finish_reason=None if late else r.finish_reason,
            timed_out=late,
        )
        if not times:
            rec.end = deadline if late else r.finished
        # poise serve sends response headers when the engine takes a request, at a step
        # boundary; the simulated equivalent is the start of its first step.
        rec.header = r.first_scheduled
        out.append(rec)
    return out


def _scrapes(result: Any, interval: float) -> list[Any]:
    """The timeline sampled like a Prometheus scraper every ``interval`` virtual seconds."""
    from poise.bench.prom import Scrape

    out, preempted, i, t = [], 0.0, 0, 0.0
    steps = result.timeline
    end = steps[-1].end_time if steps else 0.0
    last = None
    while t <= end + interval:
        while i < len(steps) and steps[i].end_time <= t:
            last = steps[i]
            preempted += last.num_preemptions
            i += 1
        if last is not None:
            out.append(
                Scrape(t, last.kv_cache_usage, last.num_running, last.num_waiting, preempted)
            )
        else:
            out.append(Scrape(t, 0.0, 0.0, 0.0, 0.0))
        t += interval
    return out


def _sim_summary(result: Any) -> dict[str, Any]:
    """Exact step-weighted server numbers (the scrapes above only sample them)."""
    steps = result.timeline
    busy = sum(s.end_time - s.start_time for s in steps) or 1.0

    def wmean(key: str) -> float:
        return sum(getattr(s, key) * (s.end_time - s.start_time) for s in steps) / busy

    return {
        "steps": result.num_steps,
        "virtual_s": round(result.duration_s, 4),
        "busy_s": round(result.busy_s, 4),
        "wall_s": round(result.wall_s, 3),
        "requests_per_wall_s": round(result.requests_per_wall_s, 1),
        "num_kv_blocks": result.num_kv_blocks,
        "max_model_len": result.max_model_len,
        "preemptions": result.num_preemptions,
        "kv_usage_mean": round(wmean("kv_cache_usage"), 4) if steps else None,
        "kv_usage_peak": max((s.kv_cache_usage for s in steps), default=None),
        "running_mean": round(wmean("num_running"), 2) if steps else None,
        "waiting_mean": round(wmean("num_waiting"), 2) if steps else None,
    }


def check_simulable(workload: Any) -> None:
    """Refuse what the simulator cannot honour (rather than ignore it): it ends every request
    at max_tokens and does not sample."""
    if not workload.ignore_eos or workload.temperature != 0:
        raise ValueError(
            "the simulator ends every request at max_tokens and does not sample: "
            "--no-ignore-eos and --temperature need a live server"
        )


def simulate_bench_cell(
    cfg: Any,
    spec: Any,
    engine_config: Any,
    cost_model: Any,
    lengths: Any,
    salt: str | None,
    arrival: Any = None,
    cluster: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """One bench cell through the simulator: (bench CellResult, SimResult). ``arrival``: the
    client arrival model (``poise.sim.arrival.ArrivalModel``; None: requests reach the engine
    as they are sent). ``cluster`` ({replicas, router_config, pools}): that many replicas
    behind the router."""
    from poise.bench.bench_config import cell_counts, cell_requests
    from poise.bench.record import build_cell
    from poise.sim.arrival import ArrivalModel
    from poise.sim.simulator import SimCell, simulate_cell
    from poise.sim.tokens import to_sim_requests

    check_simulable(cfg)
    warmup, _ = cell_counts(cfg, spec)
    reqs = cell_requests(cfg, spec)
    sched = {"send_class": cfg.send_class, "class_priority": cfg.class_priority}
    if salt and cfg.salt_scope == "request":
        sims = [
            to_sim_requests([r], lengths, salt=f"{salt}-{r.index}", num_warmup=warmup, **sched)[0]
            for r in reqs
        ]
    else:
        sims = to_sim_requests(reqs, lengths, salt=salt, num_warmup=warmup, **sched)
    cell = SimCell(
        sims,
        concurrency=spec.concurrency,
        open_loop=not spec.closed_loop,
        duration_s=cfg.duration,
    )
    result: Any
    if cluster:
        from poise.sim.cluster import simulate_cluster

        result = simulate_cluster(
            engine_config,
            cost_model,
            cell,
            seed=cfg.seed,
            arrival=arrival or ArrivalModel(),
            **cluster,
        )
    else:
        result = simulate_cell(
            engine_config, cost_model, cell, seed=cfg.seed, arrival=arrival or ArrivalModel()
        )
    out = build_cell(
        cell_load(cfg, spec, salt),
        _records(result, cfg.timeout_s),
        slo=cfg.slo(),
        scrapes=_scrapes(result, cfg.scrape_interval),
        started_at=None,
    )
    out.server["sim"] = _sim_summary(result)
    # What the prefix-cache counters would give over the measured requests (live cells scrape it).
    measured = [r for r in result.requests if not r.warmup]
    prompt = sum(r.num_prompt_tokens for r in measured)
    out.server["prefix_cache_hit_rate"] = (
        round(sum(r.num_cached_tokens for r in measured) / prompt, 4) if prompt else None
    )
    if cluster:
        out.server["router"] = result.router
    return out, result


def simulate_matrix(
    cfg: Any,
    engine_config: Any,
    cost_model: Any,
    lengths: Any,
    arrival: Any = None,
    cluster: dict[str, Any] | None = None,
) -> Any:
    """Every cell of a BenchConfig through the simulator: an ExperimentRecord (simulated)."""
    from poise.sim.arrival import ArrivalModel

    arrival = arrival or ArrivalModel()
    from poise.bench.record import ExperimentRecord
    from poise.bench.runner import experiment_block

    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    run_salt = SIM_SALT if cfg.salt == "auto" else (cfg.salt or None)
    cells, total, sim_wall = [], 0, 0.0
    for i, spec in enumerate(cfg.cells()):
        salt = f"{run_salt}-{i}" if run_salt and cfg.salt_scope != "run" else run_salt
        cell, result = simulate_bench_cell(
            cfg, spec, engine_config, cost_model, lengths, salt, arrival, cluster
        )
        cells.append(cell)
        total += len(result.requests)
        sim_wall += result.wall_s
    wall = time.perf_counter() - t0
    exp = experiment_block(cfg, cost_model.name, "poise (simulated)")
    exp["server_args"] = engine_config.to_flat_dict()
    exp["replicas"] = cluster["replicas"] if cluster else 1
    if cluster:
        exp["router"] = cluster["router_config"].policy
    exp["gpu"] = cost_model.describe().get("accelerator") or cost_model.provenance.get("device")
    return ExperimentRecord(
        experiment=exp,
        cells=cells,
        kind="simulated",
        capabilities={"ok": True, "simulated": True},
        provenance={
            "command": cfg.command,
            "tool_version": "poise-simulate 0.1",
            "started_at": started,
            "wall_s": round(wall, 3),  # including records and metrics
            "simulation_wall_s": round(sim_wall, 3),  # the engine loops alone
            "simulated_requests": total,
            "simulated_requests_per_wall_s": round(total / sim_wall, 1) if sim_wall > 0 else None,
            "cost_model": cost_model.describe(),
            "arrival_model": arrival.describe(),
            "config": cfg.to_dict(),
        },
    )
