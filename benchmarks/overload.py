"""Overload at N x capacity, open loop, against a real ``poise serve`` (issue 16, item 4).

One run, two phases against the same server process (the embedded SmolLM2-135M in bfloat16
unless ``--model``: a real model makes the engine, not the HTTP layer, the bottleneck, so
"capacity" means what the engine can serve; a tiny random checkpoint steps in ~2 ms and the
HTTP stack would saturate first):

1. capacity: a closed loop of ``2 x --max-num-seqs`` streams for ``--capacity-s`` seconds
   (every slot busy and a request waiting for each); capacity = requests completed per second.
2. overload: an open loop at ``--factor`` x that rate for ``--overload-s`` seconds, arrivals
   Poisson (seeded), each request sent at its scheduled time whatever the answers so far.

The clients run in a separate process (this script with ``--client``; aiohttp, connections
opened before the phase starts), so the server's event loop and GIL are not the client's. The
server runs with predictive admission (``--admission-control predictive``), one traffic class
whose ``ttft_p95_ms`` is ``--ttft-target-ms`` and ``--admission-margin``; the bound the
accepted requests must keep is ``target x (1 + margin)``, what admission enforces.

Reported: offered (scheduled) and actual send rate, how late sends were, accepted (200),
refused (429, and how many carried a ``Retry-After``), other statuses and transport errors,
accepted TTFT p50/p95/max client side (send to first content chunk) and engine side
(``include_metrics``: arrival in the handler to the step that sampled the first token), the
bound, and the server's RSS (``/proc``) before, at the end, and its peak during the phase.

    .venv/bin/python benchmarks/overload.py [--factor 10] [--overload-s 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from poise.core.timing import percentile
from poise.lab.managed_server import ManagedServer, ServerSpec

# ---- the client process ------------------------------------------------------------------


async def _one(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": f"Request {i}: count from one to ten.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "include_metrics": True,
        "temperature": 0,
    }
    sent = time.monotonic()
    rec: dict[str, Any] = {"sent": sent, "status": 0}
    try:
        async with session.post(url, json=body) as r:
            rec["status"] = r.status
            if r.status != 200:
                rec["retry_after"] = r.headers.get("Retry-After")
                rec["message"] = (await r.text())[:300]
                return rec
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                if "ttft" not in rec:
                    rec["ttft"] = time.monotonic() - sent
                chunk = json.loads(line[6:])
                if chunk.get("metrics"):
                    rec["engine_ttft"] = chunk["metrics"]["time_to_first_token_ms"] / 1000
        rec["done"] = time.monotonic()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        rec["error"] = type(exc).__name__
    return rec


async def _open(session: aiohttp.ClientSession, root: str, n: int) -> None:
    """Open ``n`` keep-alive connections now (the connector keeps them for the phase)."""

    async def ping() -> None:
        async with session.get(root + "/health") as r:
            await r.read()

    await asyncio.gather(*(ping() for _ in range(n)))


async def _closed(root: str, concurrency: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(300)) as s:
        await _open(s, root, concurrency)
        records: list[dict[str, Any]] = []
        start = time.monotonic()
        end = start + seconds

        async def worker(w: int) -> None:
            i = w
            while time.monotonic() < end:
                rec = await _one(s, root + "/v1/completions", i, max_tokens)
                records.append(rec)
                i += concurrency
                if rec["status"] == 429:  # counted; a closed loop must not hammer
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return {"start": start, "end": time.monotonic(), "records": records}


async def _open_loop(
    root: str, rate: float, seconds: float, max_tokens: int, connections: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        times.append(t)
    conn = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(300)) as s:
        await _open(s, root, connections)
        start = time.monotonic()
        tasks = []
        for i, at in enumerate(times):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(s, root + "/v1/completions", i, max_tokens)))
        records = list(await asyncio.gather(*tasks))
    for rec, at in zip(records, times, strict=True):
        rec["late"] = rec["sent"] - (start + at)
    return {"start": start, "end": time.monotonic(), "records": records}


def client_main(args: argparse.Namespace) -> None:
    if args.client == "closed":
        out = asyncio.run(_closed(args.root, args.concurrency, args.seconds, args.max_tokens))
    else:
        out = asyncio.run(
            _open_loop(
                args.root, args.rate, args.seconds, args.max_tokens, args.connections, args.seed
            )
        )
    json.dump(out, sys.stdout)


# ---- the driver --------------------------------------------------------------------------


def _client(root: str, *flags: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--client", *flags, "--root", root]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"client failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout))


def _rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


class _RssSampler(threading.Thread):
    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s, self.samples = pid, every_s, [_rss_mib(pid)[0]]
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.every_s):
            self.samples.append(_rss_mib(self.pid)[0])

    def stop(self) -> list[float]:
        self._stop_event.set()
        self.join()
        self.samples.append(_rss_mib(self.pid)[0])
        return self.samples


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _summary(phase: dict[str, Any]) -> dict[str, Any]:
    recs = phase["records"]
    ok = [r for r in recs if r["status"] == 200 and "error" not in r]
    sends = sorted(r["sent"] for r in recs)
    span = sends[-1] - sends[0] if len(sends) > 1 else float("nan")
    refused = [r for r in recs if r["status"] == 429]
    client = [r["ttft"] for r in ok if "ttft" in r]
    engine = [r["engine_ttft"] for r in ok if "engine_ttft" in r]
    late = [r["late"] for r in recs if "late" in r]
    statuses: dict[str, int] = {}
    for r in recs:
        key = r.get("error") or str(r["status"])
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "requests": len(recs),
        "seconds": phase["end"] - phase["start"],
        # CLOCK_MONOTONIC, the same in every process here: to line the phase up with a server log.
        "start_monotonic": phase["start"],
        "send_span_s": span,
        "actual_rate": (len(sends) - 1) / span if len(sends) > 1 else float("nan"),
        "accepted": len(ok),
        "refused_429": len(refused),
        "refused_with_retry_after": sum(1 for r in refused if r.get("retry_after")),
        "retry_after_s": sorted({int(r["retry_after"]) for r in refused if r.get("retry_after")}),
        "statuses": statuses,
        "late_p50_s": percentile(late, 50) if late else None,
        "late_p99_s": percentile(late, 99) if late else None,
        "client_ttft_s": {q: percentile(client, q) for q in (50, 95, 100)} if client else {},
        "engine_ttft_s": {q: percentile(engine, q) for q in (50, 95, 100)} if engine else {},
        "num_engine_ttft": len(engine),
        "refusal_samples": [r.get("message") for r in refused[:: max(1, len(refused) // 5)]],
        # Per accepted request: when it was sent (seconds into the phase) and its engine TTFT,
        # to see where in the phase the slow ones were (a transient at the start, or steady).
        "accepted_timeline": [
            (round(r["sent"] - phase["start"], 3), round(r["engine_ttft"], 3))
            for r in ok
            if "engine_ttft" in r
        ],
    }


def _rejections(root: str) -> dict[str, float]:
    with urllib.request.urlopen(root + "/metrics", timeout=10) as r:  # noqa: S310 - loopback
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("poise:requests_rejected_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ttft-target-ms", type=float, default=1000.0)
    p.add_argument("--admission-margin", type=float, default=0.25)
    p.add_argument("--capacity-s", type=float, default=15.0)
    p.add_argument("--overload-s", type=float, default=20.0)
    p.add_argument("--factor", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument("--port", type=int, default=None, help="the server's port (default: a free one)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra poise serve argument (engine or server), e.g. scheduling_policy=slo",
    )
    # The client process's own arguments.
    p.add_argument("--client", choices=["closed", "open"], help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    p.add_argument("--connections", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client_main(args)
        return

    bound_s = args.ttft_target_ms / 1000 * (1 + args.admission_margin)
    server_args: dict[str, Any] = {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "traffic_classes": f"chat:ttft_p95_ms={args.ttft_target_ms:g}",
        "admission_control": "predictive",
        "admission_margin": args.admission_margin,
        "enable_per_request_metrics": True,
        "max_connections": 10_000,
        "timeout_keep_alive": 120,
    }
    for kv in args.server_arg:
        key, _, value = kv.partition("=")
        server_args[key] = value
    spec = ServerSpec("poise", model=args.model, args=server_args)
    log = Path(tempfile.gettempdir()) / f"poise_overload_server_{os.getpid()}.log"
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with ManagedServer(spec, log, port=args.port) as server:
        root = server.base_url.removesuffix("/v1")
        pid = server.pid
        assert pid is not None
        common = ["--max-tokens", str(args.max_tokens)]
        _client(root, "closed", "--concurrency", "2", "--seconds", "3", *common)  # warm-up
        # One stream per sequence slot: each slot busy, nothing queued for admission to refuse.
        conc = args.max_num_seqs
        cap_phase = _client(
            root, "closed", "--concurrency", str(conc), "--seconds", str(args.capacity_s), *common
        )
        cap = _summary(cap_phase)
        capacity = cap["accepted"] / cap["seconds"]
        if capacity <= 0:
            raise RuntimeError(f"nothing served in the capacity phase: {cap['statuses']}")
        rate = args.factor * capacity
        rss_before, _ = _rss_mib(pid)
        rejected_before = _rejections(root)
        sampler = _RssSampler(pid)
        sampler.start()
        # Enough connections for every request in flight: the accepted ones for about the
        # bound plus their decode, the refused ones for a moment.
        connections = min(4000, max(64, int(rate * (bound_s + 2.0))))
        over_phase = _client(
            root,
            "open",
            "--rate",
            f"{rate:.3f}",
            "--seconds",
            str(args.overload_s),
            "--connections",
            str(connections),
            "--seed",
            str(args.seed),
            *common,
        )
        rss = sampler.stop()
        rss_end, rss_peak = _rss_mib(pid)
        rejected = {k: v - rejected_before.get(k, 0.0) for k, v in _rejections(root).items()}
    over = _summary(over_phase)
    load_after = os.getloadavg()
    result = {
        "started": started,
        "model": args.model or "embedded SmolLM2-135M",
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_tokens": args.max_tokens,
        "ttft_target_ms": args.ttft_target_ms,
        "admission_margin": args.admission_margin,
        "bound_s": bound_s,
        "capacity_rps": capacity,
        "capacity_phase": cap,
        "offered_rps": rate,
        "overload": over,
        "server_rejections": rejected,
        "rss_mib": {
            "before": rss_before,
            "end": rss_end,
            "max_sampled": max(rss),
            "hwm_process": rss_peak,
        },
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }
    print(
        f"{started}, load {load_before[0]:.1f} -> {load_after[0]:.1f}; "
        f"{result['model']} {args.dtype}, max_num_seqs {args.max_num_seqs}, "
        f"max_tokens {args.max_tokens}"
    )
    print(
        f"capacity (closed loop, c={conc}, {cap['seconds']:.1f} s): {capacity:.2f} req/s, "
        f"TTFT p95 {_ms(cap['client_ttft_s'].get(95))} ms client, statuses {cap['statuses']}"
    )
    print(
        f"overload: {args.factor:g}x = {rate:.1f} req/s scheduled (Poisson) for "
        f"{args.overload_s:g} s; sent {over['requests']} at {over['actual_rate']:.1f} req/s "
        f"(send lateness p50 {_ms(over['late_p50_s'])} ms, p99 {_ms(over['late_p99_s'])} ms)"
    )
    print(
        f"  accepted {over['accepted']}, 429 {over['refused_429']} "
        f"({over['refused_with_retry_after']} with Retry-After {over['retry_after_s']}), "
        f"statuses {over['statuses']}; server rejections {rejected}"
    )
    ct, et = over["client_ttft_s"], over["engine_ttft_s"]
    print(
        f"  accepted TTFT p50/p95/max: client {_ms(ct.get(50))}/{_ms(ct.get(95))}/"
        f"{_ms(ct.get(100))} ms, engine {_ms(et.get(50))}/{_ms(et.get(95))}/"
        f"{_ms(et.get(100))} ms; bound {bound_s * 1000:.0f} ms "
        f"(target {args.ttft_target_ms:g} x (1 + {args.admission_margin:g}))"
    )
    print(
        f"  server RSS {rss_before:.0f} -> {rss_end:.0f} MiB (max sampled {max(rss):.0f}, "
        f"process peak {rss_peak:.0f})"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
