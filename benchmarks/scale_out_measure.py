"""The measured side of benchmarks/scale_out.py: the CPU workload, one fresh ``poise serve``
per cell (plain, or ``--replicas N --router P`` on Ray Serve), the warm-up, the idle, c=1 and
relay windows that calibrate the prediction, the open-loop cell, and the cost profile."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from poise import workload as wl
from poise.bench.client import Endpoint, discover_model, make_session, now, send_one
from poise.bench.stats import RequestRecord, derive
from poise.core.timing import percentile
from poise.lab import cpu_accounting as acc
from poise.lab.managed_server import ManagedServer, ServerSpec
from poise.router import RouterConfig
from poise.sim.cpu_share import SharedCpu, fit_relay

REPO = Path(__file__).resolve().parents[1]
# The concurrency-1 calibration cell (+1 discarded): output tokens per request, two lengths so
# that the relay's CPU per request and per token separate (sim/cpu_share.fit_relay).
CAL_TOKENS = (32, 128) * 4
IDLE_S = 3.0  # the idle window: the server's background CPU
RELAY_STREAMS, RELAY_TOKENS = 3, 96  # the relay window: streams per replica, tokens each
WARM_TOKENS = 8


# ---- the measured CPU cells ----------------------------------------------------------------
@dataclass(frozen=True)
class LiveRequest:
    index: int
    class_name: str
    prompt: str  # one user message, as `poise bench` sends it
    max_tokens: int
    arrival: float  # s after the cell's start


def cpu_workload(args: argparse.Namespace, replicas: int) -> list[LiveRequest]:
    """Shared system prompts and documents, each request with its own question; 25 % LONG,
    exactly spread (as the seed lab's mixes); Poisson arrivals."""
    rng = random.Random(args.seed)
    systems = [
        f"You are assistant {k} of the scheduling team. "
        + wl.filler_text(args.cpu_system_words, rng)
        for k in range(args.cpu_system_prompts)
    ]
    docs = [
        f"[log {k}]" + wl.SEED_LONG_LINE * args.cpu_long_repeat for k in range(args.cpu_long_docs)
    ]
    n = replicas * args.cpu_requests_per_replica
    times = wl.arrival_times(n, replicas * args.cpu_rate_per_replica, 1.0, args.seed)
    out = []
    for i, t in enumerate(times):
        long = int((i + 1) * 0.25) > int(i * 0.25)
        if long:
            prompt = f"{rng.choice(docs)}\n[{i}] {wl.SEED_LONG_HEAD}"
        else:
            prompt = f"{rng.choice(systems)}\n[{i}] {wl.SHORT_PROMPT}"
        out.append(LiveRequest(i, "long" if long else "short", prompt, args.cpu_max_tokens, t))
    return out


def threads_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def server_spec(replicas: int, policy: str) -> ServerSpec:
    engine = {"dtype": "bfloat16", "num_threads": 1, "log_interval": 0}
    if replicas > 1:
        engine |= {"replicas": replicas, "router": policy}
    return ServerSpec(
        name=f"poise-{replicas}x-{policy}",
        args=engine,
        env=threads_env(1),
        startup_timeout_s=300.0,
        grace_s=90.0,
    )


def warmup_prompts(replicas: int) -> list[str]:
    """One burst that reaches every replica whatever the policy: all its prompts share the chat
    template's header, so prefix affinity keeps them on one replica until it leads the others
    by more than ``max_imbalance`` (8) requests."""
    n = 1 if replicas == 1 else replicas * (RouterConfig().max_imbalance + 2)
    return [f"warm-up {j}: {wl.SHORT_PROMPT}" for j in range(n)]


async def _warm(session: aiohttp.ClientSession, ep: Endpoint, replicas: int) -> list[str]:
    """The warm-up burst (a replica loads its engine on its first request); every replica
    must have answered one, so that each holds the template's header as in the simulation."""

    async def one(prompt: str) -> str:
        body = ep.payload(prompt, WARM_TOKENS)
        body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        async with session.post(ep.chat_url, json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"warm-up: HTTP {resp.status}: {text[:300]}")
            return resp.headers.get("x-poise-replica", "engine")

    answered = list(await asyncio.gather(*(one(p) for p in warmup_prompts(replicas))))
    if len(set(answered)) < replicas:
        raise RuntimeError(f"warm-up: only {sorted(set(answered))} of {replicas} replicas answered")
    return answered


async def _metrics(session: aiohttp.ClientSession, root: str) -> dict[str, float]:
    """Prefix-cache hits and queries (prompt tokens), summed over the replicas."""
    async with session.get(root + "/metrics") as resp:
        text = await resp.text()
    out = {"hits": 0.0, "queries": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "poise:prefix_cache_hits_total":
                out["hits"] += s.value
            elif s.name == "poise:prefix_cache_queries_total":
                out["queries"] += s.value
    return out


def renice_tree(root: int, nice: int) -> int:
    """Give every thread of ``root`` and of its descendants the niceness ``nice``; returns how
    many. Ray starts its workers (the replicas, the router) at its own niceness, not the
    server's: under the benchmark lock's ``nice -n -15`` the plain server ran at -15 and the
    replicas at 0, behind everyone's test suites. Per thread: Linux's nice is per thread."""
    done = 0
    for pid in acc.descendants(root):
        for tid in acc.thread_ids(pid):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                done += 1
    return done


def is_engine(server_pid: int) -> Callable[[int, str], bool]:
    """The engine processes: the plain server itself, or Ray Serve's engine replicas."""
    return lambda pid, cmd: pid == server_pid or acc.ray_engine_replica(pid, cmd)


async def _cell(
    base_url: str, replicas: int, reqs: list[LiveRequest], timeout_s: float, server_pid: int
) -> dict[str, Any]:
    """Warm every replica, the idle and concurrency-1 calibration windows, then the open-loop
    cell; the server's CPU time (engines / the rest and the client) over each."""
    root = base_url.removesuffix("/v1")
    engines = is_engine(server_pid)
    async with make_session() as session:
        model = await discover_model(session, base_url, {})
        if model is None:
            raise RuntimeError(f"{base_url}: no model listed")
        ep = Endpoint(base_url, model)
        warm = await _warm(session, ep, replicas)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        reniced = renice_tree(server_pid, nice)  # the engine threads exist from the warm-up on
        a = acc.read(server_pid, engines)
        await asyncio.sleep(IDLE_S)
        idle = acc.split(a, acc.read(server_pid, engines))
        background = (idle.engine_s + idle.other_s) / idle.wall_s
        cal_recs, relay = [], []
        for i in range(len(CAL_TOKENS) + 1):
            n = CAL_TOKENS[i - 1] if i else CAL_TOKENS[0]
            rec = RequestRecord(i, "short", now(), max_tokens=n, warmup=i == 0)
            a = acc.read(server_pid, engines)
            await send_one(session, ep, f"calibration {i}: {wl.SHORT_PROMPT}", rec, timeout_s)
            used = acc.split(a, acc.read(server_pid, engines))
            cal_recs.append(rec)
            if i:  # the background runs on whatever the requests do: not theirs
                relay.append((derive(rec).n_out, used.other_s - background * used.wall_s))
        per_request, per_token_c1 = fit_relay(relay)
        # The relay per token with several streams per replica (its cost per token falls as
        # streams share the relay's wake-ups): RELAY_STREAMS at once per replica.
        busy = [
            RequestRecord(100 + j, "short", now(), max_tokens=RELAY_TOKENS)
            for j in range(RELAY_STREAMS * replicas)
        ]
        a = acc.read(server_pid, engines)
        await asyncio.gather(
            *(
                send_one(session, ep, f"relay {r.index}: {wl.SHORT_PROMPT}", r, timeout_s)
                for r in busy
            )
        )
        used = acc.split(a, acc.read(server_pid, engines))
        tokens = sum(derive(r).n_out for r in busy)
        rest = used.other_s - background * used.wall_s - per_request * len(busy)
        per_token = max(0.0, rest) / tokens
        before = await _metrics(session, root)
        load0 = os.getloadavg()[0]
        cpu0 = acc.read(server_pid, engines)
        t0 = now()
        recs: list[RequestRecord] = []
        tasks = []
        for r in reqs:
            delay = t0 + r.arrival - now()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(
                r.index, r.class_name, now(), intended=t0 + r.arrival, max_tokens=r.max_tokens
            )
            recs.append(rec)
            tasks.append(asyncio.create_task(send_one(session, ep, r.prompt, rec, timeout_s)))
        await asyncio.gather(*tasks)
        used = acc.split(cpu0, acc.read(server_pid, engines))
        after = await _metrics(session, root)
    bad = [r for r in recs + cal_recs + busy if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0].error}")
    queries = after["queries"] - before["queries"]
    return {
        "records": recs,
        "calibration": cal_recs,
        "warm_replicas": warm,
        "hit": (after["hits"] - before["hits"]) / queries if queries else 0.0,
        "loadavg": [load0, os.getloadavg()[0]],
        "nice": nice,
        "threads_reniced": reniced,
        "shared_cpu": SharedCpu(
            cores=len(os.sched_getaffinity(0)),
            background_cores=background,
            relay_s_per_request=per_request,
            relay_s_per_token=per_token,
        ),
        "relay_samples": relay,
        "relay_s_per_token_c1": per_token_c1,
        "cell_cpu": dataclasses.asdict(used),
    }


def summarize(recs: list[RequestRecord]) -> dict[str, float]:
    stats = [derive(r) for r in recs]
    ttft = [s.ttft for s in stats if s.ttft is not None]
    tokens = sum(s.n_out for s in stats)
    span = max(r.events[-1] for r in recs if r.events) - min(r.start for r in recs)
    return {
        "ttft_p50_ms": 1000 * (percentile(ttft, 50) or 0.0),
        "ttft_p95_ms": 1000 * (percentile(ttft, 95) or 0.0),
        "tok_s": tokens / span,
        "span_s": span,
    }


def measure_cell(
    replicas: int, policy: str, reqs: list[LiveRequest], out: Path, timeout_s: float
) -> dict[str, Any]:
    spec = server_spec(replicas, policy)
    server = ManagedServer(spec, out / f"serve-{replicas}x-{policy}.log")
    t0 = time.monotonic()
    try:
        server.start().wait_ready()
        started = time.monotonic() - t0
        assert server.pid is not None
        res = asyncio.run(_cell(server.base_url, replicas, reqs, timeout_s, server.pid))
    finally:
        server.stop()  # SIGTERM to its process group; poise serve --replicas stops Serve and Ray
    res |= summarize(res["records"]) | {
        "startup_s": started,
        "replicas": replicas,
        "policy": policy,
    }
    return res


def profile(out: Path, repeats: int) -> Path:
    path = out / "profile.json"
    argv = [
        sys.executable,
        "-m",
        "poise",
        "profile",
        "--grid",
        "quick",
        "--repeats",
        str(repeats),
        "--threads",
        "1",
        "--clock",
        "cpu",
        "--dtype",
        "bfloat16",
        "-o",
        str(path),
    ]
    print("$", " ".join(argv[1:]), flush=True)
    with open(out / "profile.log", "w") as log:
        subprocess.run(
            argv, cwd=REPO, env={**os.environ, **threads_env(1)}, check=True, stdout=log, stderr=log
        )
    return path
