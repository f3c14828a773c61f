"""The simulator's side of benchmarks/scale_out.py: the simulated H100 fleet (``--part sim``)
and the prediction of each measured CPU cell (its requests replayed with their real token
ids through ``sim/cluster.py``, calibrated from the cell's idle and c=1 windows)."""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from scale_out_measure import WARM_TOKENS, LiveRequest, warmup_prompts

from poise.config import EngineConfig
from poise.core.timing import percentile
from poise.lab.calibration import request_timing
from poise.router import RouterConfig
from poise.sim import calibrate as cal
from poise.sim.arrival import ArrivalModel
from poise.sim.cell import SimCell, SimRequest
from poise.sim.cluster import simulate_cluster
from poise.sim.cost import CostModel
from poise.sim.cpu_share import SharedCpu
from poise.sim.roofline import RooflineCostModel

LONG, SHORT = 3363, 600
METRICS = ("hit", "ttft_p95_ms", "tok_s")
WARM_LEAD_S = 10.0  # simulated: the warm-up burst, then the cell this much later


# ---- the simulated H100 fleet --------------------------------------------------------------
def workload(n: int, rate: float, long_docs: int, systems: int, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < 0.25
        key = f"doc{rng.randrange(long_docs)}" if long else f"sys{rng.randrange(systems)}"
        out.append(
            SimRequest(
                i,
                LONG if long else SHORT,
                160,
                arrival=t,
                prompt_key=key,
                class_name="long" if long else "short",
            )
        )
    return out


def run(
    replicas: int,
    policy: str,
    reqs: list[SimRequest],
    config: EngineConfig,
    cost: Any,
    seed: int = 0,
    arrival: ArrivalModel = ArrivalModel(),
    shared_cpu: SharedCpu | None = None,
) -> dict[str, Any]:
    res = simulate_cluster(
        config,
        cost,
        SimCell(reqs, open_loop=True),
        replicas=replicas,
        router_config=RouterConfig(policy=policy),
        seed=seed,
        arrival=arrival,
        shared_cpu=shared_cpu,
    )
    measured = [r for r in res.requests if not r.warmup]
    ok = [r for r in measured if r.ok]
    ttft = sorted(r.ttft or 0.0 for r in ok)
    tokens = sum(len(r.token_times) for r in ok)
    span = max(r.token_times[-1] for r in ok) - min(r.sent for r in measured)
    prompt = sum(r.num_prompt_tokens for r in ok)
    return {
        "replicas": replicas,
        "policy": policy,
        "ok": len(ok),
        "n": len(measured),
        "hit": sum(r.num_cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * (percentile(ttft, 50) or 0.0),
        "ttft_p95_ms": 1000 * (percentile(ttft, 95) or 0.0),
        "tok_s": tokens / span if span > 0 else 0.0,
        "wall_s": res.wall_s,
        "engine_share": res.mean_engine_share,
    }


def sim_part(args: argparse.Namespace) -> None:
    cost = RooflineCostModel.build(args.model_shape, args.accelerator, dtype="bfloat16")
    config = EngineConfig.from_kwargs(
        max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=8192, gpu_memory_utilization=0.9
    )
    print(
        f"## simulated: {args.model_shape} on {args.accelerator} (roofline), "
        f"{args.rate_per_replica} req/s and {args.requests_per_replica} requests per replica\n"
    )
    print(
        "| replicas | router | ok | prefix-cache hit | TTFT p50 ms | TTFT p95 ms | output tok/s "
        "| TTFT p95 / round_robin | tok/s / round_robin |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.replicas.split(",")):
        reqs = workload(
            n * args.requests_per_replica,
            n * args.rate_per_replica,
            args.long_docs,
            args.system_prompts,
            args.seed,
        )
        base: dict[str, Any] | None = None
        for policy in args.policies.split(","):
            r = run(n, policy, reqs, config, cost)
            base = base or r
            print(
                f"| {n} | {policy} | {r['ok']}/{r['n']} | {r['hit']:.3f} | {r['ttft_p50_ms']:.0f} "
                f"| {r['ttft_p95_ms']:.0f} | {r['tok_s']:.0f} "
                f"| {r['ttft_p95_ms'] / base['ttft_p95_ms']:.2f} | {r['tok_s'] / base['tok_s']:.2f} |",
                flush=True,
            )


# ---- the prediction of the measured CPU cells ----------------------------------------------
def sim_requests(reqs: list[LiveRequest], replicas: int) -> list[SimRequest]:
    """The measured requests with their real token ids (the server's template and tokenizer),
    after the same warm-up burst as the real server got."""
    from poise.text.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(None)

    def ids(prompt: str) -> tuple[int, ...]:
        return tuple(apply_chat_template(tok, [{"role": "user", "content": prompt}]))

    warm = [
        SimRequest(
            len(reqs) + j,
            len(w),
            WARM_TOKENS,
            arrival=0.0,
            class_name="warmup",
            prompt_key=f"warm{j}",
            warmup=True,
            token_ids=w,
        )
        for j, w in enumerate(map(ids, warmup_prompts(replicas)))
    ]
    cell = [
        SimRequest(
            r.index,
            len(w),
            r.max_tokens,
            arrival=WARM_LEAD_S + r.arrival,
            class_name=r.class_name,
            prompt_key=str(r.index),
            token_ids=w,
        )
        for r, w in zip(reqs, map(ids, (r.prompt for r in reqs)), strict=True)
    ]
    return warm + cell


def way_in_s_per_token(reqs: list[LiveRequest]) -> float:
    """poise serve's chat template + tokenizer, per prompt token, on this machine (one thread)."""
    from poise.text.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(None)
    jobs = [
        lambda p=r.prompt: len(apply_chat_template(tok, [{"role": "user", "content": p}]))
        for r in reqs[:8]
    ]
    return cal.time_per_token(jobs, repeats=5)


def predict(
    cell: dict[str, Any],
    reqs: list[SimRequest],
    model: CostModel,
    way_in: float,
    seeds: int,
    shared: bool = True,
) -> dict[str, Any]:
    """The simulator's prediction of a measured cell, calibrated from its idle and c=1 windows:
    with ``shared``, the replicas share this machine's cores with the relay (the server's
    threads outside the engines and the client, as measured there); without, each replica has
    a core of its own."""
    timings = tuple(request_timing(r) for r in cell["calibration"] if not r.warmup)
    c = cal.calibrate(model, [cal.CalibrationCell(timings, None, "c1")])
    cost, arrival = c.apply(model, ArrivalModel(way_in_workers=1, way_in_s_per_token=way_in))
    config = EngineConfig.from_kwargs(dtype="bfloat16", num_threads=1)
    cpu = cell["shared_cpu"] if shared else None
    runs = [
        run(
            cell["replicas"],
            cell["policy"],
            reqs,
            config,
            cost,
            seed=s,
            arrival=arrival,
            shared_cpu=cpu,
        )
        for s in range(seeds)
    ]
    med = {
        m: statistics.median(r[m] for r in runs)
        for m in ("hit", "ttft_p50_ms", "ttft_p95_ms", "tok_s", "engine_share")
    }
    med["seed_range"] = {m: [min(r[m] for r in runs), max(r[m] for r in runs)] for m in METRICS}
    med["calibration"] = {
        "time_scale": c.time_scale,
        "step_jitter_cv": c.step_jitter_cv,
        "request_overhead_s": c.request_overhead_s,
        "way_in_s_per_token": way_in,
        "shared_cpu": cpu.describe() if cpu else None,
    }
    return med
