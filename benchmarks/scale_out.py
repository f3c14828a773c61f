"""Scale-out: engine replicas behind poise's router, simulated on H100s and measured on this CPU.

One run, two parts (``--part sim`` or ``--part measured`` runs one, for development):

**sim**: 1, 2, 4, 8 H100 replicas of a Qwen2.5-7B engine (roofline) behind each router policy
(``sim/cluster.py``: N copies of the real scheduler behind the router, virtual time). Open loop,
Poisson arrivals at ``--rate-per-replica`` x replicas; 25 % LONG prompts (one of ``--long-docs``
shared documents of 3,363 tokens, the seed's LONG length), 75 % SHORT ones (one of
``--system-prompts`` shared prompts of 600 tokens: a system prompt plus a question). Requests
with the same key get the same token ids, so a shared prompt is shared whole. 160 output tokens.

**measured**: the same kind of workload, sized for this CPU, against ``poise serve`` with one
replica (the plain server: one engine, no Ray) and ``poise serve --replicas 2 --router P``
(Ray Serve on a local Ray instance, each replica one CPU and one torch thread) for each policy
of ``--cpu-policies``, the embedded SmolLM2-135M in bfloat16. Each cell gets a fresh server (cold
caches). Per cell: prefix-cache hit rate (the replicas' own counters, hits over prompt tokens
looked up), TTFT p50/p95 and output tokens/s (all output tokens over first send to last token),
from `poise bench`'s client. The workload (seeded): ``--cpu-system-prompts`` system prompts of
``--cpu-system-words`` words and ``--cpu-long-docs`` documents of ``--cpu-long-repeat`` of the
seed's log lines (the seed's 220 would take ~3 s of one core per cold prefill here); each request
is one of them followed by its own question (the seed's SHORT question, or its LONG
instruction), 25 % LONG exactly spread, ``--cpu-max-tokens`` output tokens (ignore_eos),
Poisson at ``--cpu-rate-per-replica`` x replicas.

The simulator's prediction of the same cells: a cost profile of this machine measured at the
start of the run (``poise profile --threads 1 --clock cpu``: the runner thread's CPU time),
calibrated per server from a concurrency-1 cell run on it before its compared cell (time scale:
measured TPOT over the profile's decode step; request overhead: median response-header latency;
the way in: the chat template and tokenizer timed per prompt token, one FIFO worker), the same
requests with their real token ids (so a shared system prompt is shared as on the server,
template included) through ``sim/cluster.py`` with the same router code; median over
``--sim-seeds`` seeds of the step jitter. Ratios simulated / measured; the target is the
2-replica cells within ``--tolerance`` (20 %) in TTFT p95 and tokens/s.

The replicas share this machine's cores with what relays their traffic (Ray's proxy, the
router, the replicas' event loops, the client): the prediction runs them on shared cores
(``sim/cpu_share.SharedCpu``: each busy engine thread gets (cores - relay) / busy engines of a
core), with the relay measured per server before its compared cell, from the CPU time of the
server's process tree and of this client (``poise.lab.cpu_accounting``): the background of an
idle window (``IDLE_S``), then per request of the c=1 cell, whose requests alternate two
lengths so that the cost per request and per token separate, then the cost per token again
from a window of ``RELAY_STREAMS`` streams per replica at once (net of the background and the
per-request cost): at c=1 each token wakes the whole relay alone, and the per-token cost read
there modelled about twice the relay CPU the cells used (RESULTS.md). Nothing is read from the compared
cell but what the report checks the relay model with (its measured relay CPU). A prediction
with a core per replica is printed next to it for comparison.

    flock /work/bench.lock nice -n -15 .venv/bin/python benchmarks/scale_out.py
    .venv/bin/python benchmarks/scale_out.py --part sim --replicas 1,2,4,8
    .venv/bin/python benchmarks/scale_out.py --part measured --profile runs/.../profile.json

Stop every server it starts (Ray included) by its process group, whatever happens.

Only the protocol and the command line are here: the measured cells in scale_out_measure.py,
the simulator's side (the H100 fleet, the predictions) in scale_out_sim.py, the tables in
scale_out_report.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from scale_out_measure import REPO, cpu_workload, measure_cell, profile
from scale_out_report import report
from scale_out_sim import predict, sim_part, sim_requests, way_in_s_per_token

from poise.sim.fit import load_profile


def measured_part(args: argparse.Namespace) -> bool | None:
    out = args.out_dir / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    print(f"## measured on this CPU ({out})", flush=True)
    model_path = args.profile or profile(out, args.profile_repeats)
    model = load_profile(model_path)
    cells: list[dict[str, Any]] = []
    plan = [(1, "round_robin")] + [(2, p) for p in args.cpu_policies.split(",")]
    for n, policy in plan:
        reqs = cpu_workload(args, n)
        print(f"cell: {n} replica(s), {policy}, {len(reqs)} requests", flush=True)
        cell = measure_cell(n, policy, reqs, out, args.timeout)
        print(
            f"  measured: hit {cell['hit']:.3f}, TTFT p95 {cell['ttft_p95_ms']:.0f} ms, "
            f"{cell['tok_s']:.1f} tok/s (startup {cell['startup_s']:.0f} s, load "
            f"{cell['loadavg'][0]:.1f}-{cell['loadavg'][1]:.1f}, nice {cell['nice']} on "
            f"{cell['threads_reniced']} threads)",
            flush=True,
        )
        cell["reqs"] = reqs
        cells.append(cell)
    way_in = way_in_s_per_token(cells[-1]["reqs"])
    for cell in cells:
        replay = sim_requests(cell["reqs"], cell["replicas"])
        cell["sim"] = predict(cell, replay, model, way_in, args.sim_seeds)
        cell["sim_own_cores"] = predict(cell, replay, model, way_in, args.sim_seeds, shared=False)
    return report(cells, out, args.tolerance, model_path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "sim", "measured"), default="all")
    g = p.add_argument_group("sim", "the simulated H100 fleet")
    g.add_argument("--replicas", default="1,2,4,8")
    g.add_argument("--policies", default="round_robin,least_loaded,prefix_affinity,balanced")
    g.add_argument("--requests-per-replica", type=int, default=100)
    g.add_argument("--rate-per-replica", type=float, default=10.0)
    g.add_argument("--long-docs", type=int, default=4)
    g.add_argument("--system-prompts", type=int, default=8)
    g.add_argument("--accelerator", default="h100")
    g.add_argument("--model-shape", default="Qwen2.5-7B-Instruct")
    m = p.add_argument_group("measured", "1 vs 2 replicas on this CPU, and their simulation")
    m.add_argument("--cpu-policies", default="round_robin,prefix_affinity,balanced")
    m.add_argument("--cpu-requests-per-replica", type=int, default=40)
    m.add_argument("--cpu-rate-per-replica", type=float, default=0.75)
    m.add_argument("--cpu-system-prompts", type=int, default=4)
    m.add_argument("--cpu-system-words", type=int, default=200)
    m.add_argument("--cpu-long-docs", type=int, default=2)
    m.add_argument("--cpu-long-repeat", type=int, default=60)
    m.add_argument("--cpu-max-tokens", type=int, default=160)
    m.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="A cost profile to use (default: measured now, --grid quick).",
    )
    m.add_argument("--profile-repeats", type=int, default=3)
    m.add_argument("--sim-seeds", type=int, default=5)
    m.add_argument("--tolerance", type=float, default=0.20)
    m.add_argument("--timeout", type=float, default=600.0, help="Per request, seconds.")
    m.add_argument("--out-dir", type=Path, default=REPO / "runs" / "scale_out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    # SIGTERM (a timeout, the lock's owner) ends the run through the finally blocks that stop
    # the servers, Ray included, rather than leaving them behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    ok: bool | None = None
    if args.part in ("all", "sim"):
        sim_part(args)
    if args.part in ("all", "measured"):
        ok = measured_part(args)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    return 0 if ok in (None, True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
