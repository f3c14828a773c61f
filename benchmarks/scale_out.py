"""Scale-out in the simulator: 1, 2, 4, 8 H100 replicas of a Qwen2.5-7B engine behind each
router policy, on one run of a workload with several shared prompts and the seed's long/short
mix. Reports per (replicas, policy): prefix-cache hit rate, TTFT p50/p95, output tokens/s.

    .venv/bin/python benchmarks/scale_out.py --replicas 1,2,4,8 --requests-per-replica 150

Workload (seeded): open loop, Poisson arrivals at ``--rate-per-replica`` x replicas; 25 % LONG
prompts (one of ``--long-docs`` shared documents of 3,363 tokens, the seed's LONG length), 75 %
SHORT ones (one of ``--system-prompts`` shared prompts of 600 tokens: a system prompt plus a
question). The simulator gives requests with the same key the same token ids, so a shared
prompt is shared whole (as the seed's LONG prompts are). 160 output tokens each.

Not here yet: the measured 1 vs 2 replicas on this machine and the simulator's error against
it (the issue's acceptance line; see RESULTS.md).
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from poise.config import EngineConfig
from poise.core.timing import percentile
from poise.router import RouterConfig
from poise.sim.cell import SimCell, SimRequest
from poise.sim.cluster import simulate_cluster
from poise.sim.roofline import RooflineCostModel

LONG, SHORT = 3363, 600


def workload(n: int, rate: float, long_docs: int, systems: int, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < 0.25
        key = f"doc{rng.randrange(long_docs)}" if long else f"sys{rng.randrange(systems)}"
        out.append(SimRequest(i, LONG if long else SHORT, 160, arrival=t, prompt_key=key,
                              class_name="long" if long else "short"))  # fmt: skip
    return out


def run(replicas: int, policy: str, reqs: list[SimRequest], config: EngineConfig,
        cost: Any) -> dict[str, Any]:  # fmt: skip
    res = simulate_cluster(config, cost, SimCell(reqs, open_loop=True), replicas=replicas,
                           router_config=RouterConfig(policy=policy))  # fmt: skip
    ok = [r for r in res.requests if r.ok]
    ttft = sorted(r.ttft or 0.0 for r in ok)
    tokens = sum(len(r.token_times) for r in ok)
    return {
        "replicas": replicas, "policy": policy, "ok": len(ok), "n": len(res.requests),
        "hit": res.router["prefix_cache_hit_rate"],
        "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p95_ms": 1000 * percentile(ttft, 95),
        "tok_s": tokens / res.duration_s if res.duration_s else 0.0, "wall_s": res.wall_s,
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="1,2,4,8")
    p.add_argument("--policies", default="round_robin,least_loaded,prefix_affinity,balanced")
    p.add_argument("--requests-per-replica", type=int, default=150)
    p.add_argument("--rate-per-replica", type=float, default=4.0)
    p.add_argument("--long-docs", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--accelerator", default="h100")
    p.add_argument("--model-shape", default="Qwen2.5-7B-Instruct")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cost = RooflineCostModel.build(args.model_shape, args.accelerator, dtype="bfloat16")
    config = EngineConfig.from_kwargs(max_num_seqs=64, max_num_batched_tokens=4096,
                                      max_model_len=8192, gpu_memory_utilization=0.9)  # fmt: skip
    print(f"{args.model_shape} on {args.accelerator} (roofline), {args.rate_per_replica} req/s "
          f"and {args.requests_per_replica} requests per replica")  # fmt: skip
    print("| replicas | router | ok | prefix-cache hit | TTFT p50 ms | TTFT p95 ms | output tok/s "
          "| TTFT p95 / round_robin | tok/s / round_robin |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.replicas.split(",")):
        reqs = workload(n * args.requests_per_replica, n * args.rate_per_replica,
                        args.long_docs, args.system_prompts, args.seed)  # fmt: skip
        base: dict[str, Any] | None = None
        for policy in args.policies.split(","):
            r = run(n, policy, reqs, config, cost)
            base = base or r
            print(f"| {n} | {policy} | {r['ok']}/{r['n']} | {r['hit']:.3f} | {r['ttft_p50_ms']:.0f} "
                  f"| {r['ttft_p95_ms']:.0f} | {r['tok_s']:.0f} "
                  f"| {r['ttft_p95_ms'] / base['ttft_p95_ms']:.2f} | {r['tok_s'] / base['tok_s']:.2f} |",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
