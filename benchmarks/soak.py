"""A long soak of mixed traffic against a real ``poise serve`` (issue 38, item 6).

For ``--minutes`` (30) a closed loop of ``--concurrency`` clients sends, each request drawn by
weight (seeded): the seed mix (chat, the short and long prompts, streamed or not), streams
cancelled mid-way, structured output (a ``json_schema`` response format), ``n = 3``
completions, forced tool calls (a named function, ``required``), and bad requests
(``--bad-ratio``, 5 %: an unknown model, out-of-range sampling values, malformed JSON, an
over-long ``max_tokens``, a schema that does not compile, no messages). Each minute it records
the server's RSS, threads and open files (``/proc``), its KV use and queue (``/metrics``) and
the answers so far; at the end it waits for the server to go idle and records that too.

What it checks (``--json`` has every figure): the RSS trend after the first 5 minutes
(least-squares slope, MB/min), threads and open files flat, KV back to 0 when idle, no 5xx
and no error event in a stream, every bad request answered 4xx. The server is the embedded
SmolLM2-135M in bfloat16 unless ``--model``; the client runs in this process (aiohttp), the
server in its own.

    nice -n 10 .venv/bin/python benchmarks/soak.py [--minutes 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from poise.lab.managed_server import ManagedServer, ServerSpec
from poise.workload import SHORT_PROMPT, long_prompt

KINDS = {"seed": 0.51, "cancel": 0.12, "structured": 0.12, "n3": 0.10, "tools": 0.10, "bad": 0.05}
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["title", "rating"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city"],
            },
        },
    }
]
MSG = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def _bad(rng: random.Random, model: str) -> tuple[str, Any]:
    """(path, body) of a request the server must refuse with a 4xx; body str = raw bytes."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return rng.choice(
        [
            ("/v1/chat/completions", {**chat, "model": "no-such-model"}),
            ("/v1/chat/completions", {**chat, "temperature": -1}),
            ("/v1/chat/completions", {**chat, "top_p": 7}),
            ("/v1/chat/completions", '{"model": "m", "messages": [,'),
            ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 10**9}),
            ("/v1/chat/completions", {**chat, "messages": []}),
            (
                "/v1/chat/completions",
                {
                    **chat,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {
                            "name": "x",
                            "schema": {"type": "object", "minProperties": "a"},
                        },
                    },
                },
            ),
            ("/v1/completions", {"model": model, "prompt": "x", "n": 0}),
        ]
    )


class Soak:
    def __init__(
        self, root: str, model: str, seed: int, long_repeat: int, max_tokens: int, bad_ratio: float
    ) -> None:
        self.root, self.model = root, model
        self.rng = random.Random(seed)
        self.long = long_prompt(long_repeat)
        self.max_tokens = max_tokens
        weights = dict(KINDS, bad=bad_ratio)
        weights["seed"] = max(0.0, 1.0 - sum(v for k, v in weights.items() if k != "seed"))
        self.kinds, self.weights = list(weights), list(weights.values())
        self.statuses: dict[str, dict[str, int]] = {k: {} for k in self.kinds}
        self.stream_errors = 0  # error events inside a 200 stream
        self.bad_not_4xx = 0
        self.n = 0

    def _count(self, kind: str, status: str) -> None:
        self.statuses[kind][status] = self.statuses[kind].get(status, 0) + 1
        self.n += 1

    def num_5xx(self) -> int:
        return sum(c for s in self.statuses.values() for k, c in s.items() if k.startswith("5"))

    async def one(self, session: aiohttp.ClientSession) -> None:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        r = self.rng
        model, mt = self.model, self.max_tokens
        path = "/v1/chat/completions"
        body: Any
        stream, cancel_after = False, None
        if kind == "seed":
            prompt = self.long if r.random() < 0.2 else SHORT_PROMPT
            stream = r.random() < 0.5
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": mt,
                "temperature": r.choice([0.0, 0.7]),
                "stream": stream,
            }
        elif kind == "cancel":
            stream, cancel_after = True, r.randint(1, 12)
            body = {
                "model": model,
                "messages": [{"role": "user", "content": SHORT_PROMPT}],
                "max_tokens": 64,
                "stream": True,
                "ignore_eos": True,
            }
        elif kind == "structured":
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "Review a film."}],
                "max_tokens": 96,
                "temperature": 0.7,
                "seed": r.randint(0, 10**6),
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "review", "schema": SCHEMA},
                },
            }
        elif kind == "n3":
            path = "/v1/completions"
            body = {
                "model": model,
                "prompt": "Once upon a time",
                "n": 3,
                "max_tokens": mt,
                "temperature": 0.9,
                "seed": r.randint(0, 10**6),
                "stream": r.random() < 0.5,
            }
            stream = body["stream"]
        elif kind == "tools":
            choice = r.choice(
                ["required", {"type": "function", "function": {"name": "get_weather"}}]
            )
            body = {
                "model": model,
                "messages": MSG,
                "tools": TOOLS,
                "tool_choice": choice,
                "max_tokens": 96,
                "temperature": 0.7,
            }
        else:
            path, body = _bad(r, model)
        data = body if isinstance(body, str) else json.dumps(body)
        try:
            async with session.post(
                self.root + path, data=data, headers={"Content-Type": "application/json"}
            ) as resp:
                status = str(resp.status)
                if stream and resp.status == 200:
                    events = 0
                    async for raw in resp.content:
                        line = raw.decode(errors="replace").strip()
                        if line.startswith('data: {"error"'):
                            self.stream_errors += 1
                            status = "200+error"
                        events += line.startswith("data: ")
                        if cancel_after is not None and events >= cancel_after:
                            status = "200 cancelled"
                            break  # leaving closes the connection mid-stream
                else:
                    await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            status = f"transport {type(exc).__name__}"
        if kind == "bad" and not status.startswith("4"):
            self.bad_not_4xx += 1
        self._count(kind, status)

    async def worker(self, session: aiohttp.ClientSession, until: float) -> None:
        while time.monotonic() < until:
            await self.one(session)


def _proc(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            fields[key] = float(value.split()[0])
    return {
        "rss_mib": fields["VmRSS"] / 1024,
        "threads": fields["Threads"],
        "open_files": float(len(os.listdir(f"/proc/{pid}/fd"))),
    }


def _metrics(root: str) -> dict[str, float]:
    with urllib.request.urlopen(root + "/metrics", timeout=30) as r:  # noqa: S310 - loopback
        text = r.read().decode()
    want = {
        "poise:kv_cache_usage_perc": "kv_usage",
        "poise:num_requests_running": "running",
        "poise:num_requests_waiting": "waiting",
    }
    out = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in want:
            out[want[name]] = float(line.rsplit(" ", 1)[1])
    return out


def _sample(soak: Soak, pid: int, start: float) -> dict[str, Any]:
    return {
        "minute": round((time.monotonic() - start) / 60, 2),
        **_proc(pid),
        **_metrics(soak.root),
        "requests": soak.n,
        "5xx": soak.num_5xx(),
        "stream_errors": soak.stream_errors,
    }


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (x, y)."""
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else None


async def run(args: argparse.Namespace, root: str, pid: int) -> dict[str, Any]:
    soak = Soak(root, "m", args.seed, args.long_repeat, args.max_tokens, args.bad_ratio)
    start = time.monotonic()
    until = start + args.minutes * 60
    samples = [_sample(soak, pid, start)]
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        workers = [
            asyncio.ensure_future(soak.worker(session, until)) for _ in range(args.concurrency)
        ]
        next_sample = start + 60
        while not all(w.done() for w in workers):
            await asyncio.sleep(min(1.0, max(0.0, next_sample - time.monotonic())))
            if time.monotonic() >= next_sample:
                samples.append(await asyncio.to_thread(_sample, soak, pid, start))
                s = samples[-1]
                print(
                    f"min {s['minute']:5.1f}: RSS {s['rss_mib']:.1f} MiB, threads "
                    f"{s['threads']:.0f}, files {s['open_files']:.0f}, KV {s['kv_usage']:.3f}, "
                    f"running {s['running']:.0f}, requests {s['requests']}, 5xx {s['5xx']}",
                    flush=True,
                )
                next_sample += 60
        await asyncio.gather(*workers)
    # Idle: every request answered; the engine must hold nothing.
    idle = _sample(soak, pid, start)
    deadline = time.monotonic() + 30
    while (idle["kv_usage"] or idle["running"] or idle["waiting"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        idle = _sample(soak, pid, start)
    late = [(s["minute"], s["rss_mib"]) for s in samples if s["minute"] >= 5]
    slope = _slope(late)
    after = [s for s in samples if s["minute"] >= 5] or samples
    return {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "requests": soak.n,
        "statuses": soak.statuses,
        "num_5xx": soak.num_5xx(),
        "stream_errors": soak.stream_errors,
        "bad_not_4xx": soak.bad_not_4xx,
        "rss_slope_mb_per_min_after_5": None if slope is None else slope * 1.048576,
        "threads_after_5": [min(s["threads"] for s in after), max(s["threads"] for s in after)],
        "open_files_after_5": [
            min(s["open_files"] for s in after),
            max(s["open_files"] for s in after),
        ],
        "idle": idle,
        "samples": samples,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=32, help="the seed mix's output cap")
    p.add_argument(
        "--long-repeat",
        type=int,
        default=40,
        help="the seed's long prompt's log line, this many times (220 in the seed)",
    )
    p.add_argument("--bad-ratio", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    server_args = {
        "dtype": args.dtype,
        "max_num_seqs": 8,
        "served_model_name": "m",
        "max_model_len": 2048,
        "timeout_keep_alive": 60,
    }
    spec = ServerSpec("poise", model=args.model, args=server_args)
    log = Path(tempfile.gettempdir()) / f"poise_soak_server_{os.getpid()}.log"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with ManagedServer(spec, log, port=args.port) as server:
        root = server.base_url.removesuffix("/v1")
        assert server.pid is not None
        result = asyncio.run(run(args, root, server.pid))
    result["started"] = started
    result["loadavg_end"] = os.getloadavg()
    s, idle = result, result["idle"]
    print(
        f"{started}: {s['minutes']:g} min, {s['requests']} requests, 5xx {s['num_5xx']}, "
        f"stream errors {s['stream_errors']}, bad requests not 4xx {s['bad_not_4xx']}"
    )
    slope = s["rss_slope_mb_per_min_after_5"]
    shown = "n/a (a run under 7 minutes)" if slope is None else f"{slope:.3f} MB/min"
    print(
        f"RSS slope after minute 5: {shown}; threads "
        f"{s['threads_after_5']}, open files {s['open_files_after_5']}; idle: KV "
        f"{idle['kv_usage']}, running {idle['running']:.0f}, waiting {idle['waiting']:.0f}"
    )
    for kind, statuses in s["statuses"].items():
        print(f"  {kind}: {statuses}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
