"""HTTP serving vs the offline engine on the same requests, in the same run.

The seed workload (``poise.workload``: 25 % the LONG prompt, 75 % the SHORT one, evenly
spread), as streaming chat completions with ``max_tokens`` 160 and ``ignore_eos``, temperature
0, in a closed loop at each concurrency (default 8, 16, 32) against ``poise serve`` (a
subprocess, bfloat16, the embedded SmolLM2 unless ``--model``), next to the offline engine
(``poise.engine.llm.LLM``'s EngineCore in this process) driven by the same closed loop over
the same chat-templated token ids. The two never run at the same time.

Reported per cell: output tokens/s (all output tokens / wall time of the cell), the HTTP /
offline ratio, TTFT p50/p95 for SHORT and LONG separately (HTTP: client-side, send to first
content chunk; offline: engine arrival to first token, ``poise.core.timing.derive``), and
where the server's CPU went (engine thread, event-loop thread, whole process, from /metrics).

    .venv/bin/python benchmarks/serving.py [--concurrency 8 16 32] [--waves W | --requests N]

``--unique-long``: every LONG prompt starts with its own request number, so no two share a
prefix block past the chat template's common preamble (its first block at most: each LONG row
holds its own ~3.4k-token context in the pool). ``--kv-cache-dtype auto int8``: one server per value, one after the other, the same
requests (issue 33: the int8 KV cache against the bf16 one in the same run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from poise.core.sampling_params import SamplingParams
from poise.core.timing import derive, percentile
from poise.workload import SHORT_PROMPT, long_positions, seed_classes

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Cell:
    mode: str  # "http" | "offline"
    concurrency: int
    num_requests: int
    output_tokens: int
    seconds: float
    ttft: dict[str, list[float]] = field(default_factory=dict)  # class -> seconds
    server_cpu: dict[str, float] = field(default_factory=dict)
    kv_cache_dtype: str = "auto"

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def ttft_ms(self, cls: str, q: float) -> float | None:
        v = percentile(self.ttft.get(cls, []), q)
        return None if v is None else 1000 * v


def workload(
    n: int, max_tokens: int, long_ratio: float, unique_long: bool = False
) -> list[tuple[str, str]]:
    """(class name, prompt) for n requests; ``unique_long``: each LONG prompt distinct from its
    first token on."""
    short, long = seed_classes(max_tokens)
    out = []
    for i, is_long in enumerate(long_positions(n, long_ratio)):
        if not is_long:
            out.append((short.name, short.prompt or ""))
            continue
        prompt = long.prompt or ""
        out.append((long.name, f"Request {i}. {prompt}" if unique_long else prompt))
    return out


# ---- offline ------------------------------------------------------------------------------


def run_offline(llm: Any, reqs: list[tuple[str, str]], c: int, max_tokens: int) -> Cell:
    """Closed loop at concurrency c on the engine core, with detokenization (as the LLM does)."""
    from poise.text import IncrementalDetokenizer, apply_chat_template

    tok = llm.tokenizer
    ids = [apply_chat_template(tok, [{"role": "user", "content": p}]) for _, p in reqs]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core, out_tokens = llm.engine, 0
    ttft: dict[str, list[float]] = {"short": [], "long": []}
    detoks: dict[str, Any] = {}
    next_i, in_flight = 0, 0
    start = time.perf_counter()
    while next_i < len(reqs) or in_flight:
        while in_flight < c and next_i < len(reqs):
            rid = f"off-{c}-{next_i}"
            core.add_request(rid, ids[next_i], params)
            detoks[rid] = (reqs[next_i][0], IncrementalDetokenizer(tok, ids[next_i], params))
            next_i, in_flight = next_i + 1, in_flight + 1
        deltas, _ = core.step()
        for d in deltas:
            cls, detok = detoks[d.request_id]
            detok.update(d.new_token_ids, d.finished)
            out_tokens += len(d.new_token_ids)
            if d.finished:
                in_flight -= 1
                m = derive(d.times) if d.times else None
                if m is not None and m.ttft is not None:
                    ttft[cls].append(m.ttft)
    return Cell("offline", c, len(reqs), out_tokens, time.perf_counter() - start, ttft)


# ---- HTTP ---------------------------------------------------------------------------------


async def _one(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, model: str
) -> tuple[float | None, int]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in obj.get("choices", [])):
                first = time.perf_counter() - sent
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    return first, tokens


async def run_http(
    base: str, model: str, reqs: list[tuple[str, str]], c: int, max_tokens: int
) -> Cell:
    url = base + "/v1/chat/completions"
    queue = list(enumerate(reqs))
    ttft: dict[str, list[float]] = {"short": [], "long": []}
    total = 0
    conn = aiohttp.TCPConnector(limit=c + 4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(3600)) as s:

        async def worker() -> None:
            nonlocal total
            while queue:
                _, (cls, prompt) = queue.pop(0)
                first, n = await _one(s, url, prompt, max_tokens, model)
                total += n
                if first is not None:
                    ttft[cls].append(first)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        seconds = time.perf_counter() - start
    return Cell("http", c, len(reqs), total, seconds, ttft)


@contextlib.contextmanager
def page_reader(base: str) -> Iterator[None]:
    """A /dashboard/feed reader (what an open live page costs the server) while in the block."""
    stop = threading.Event()

    def read() -> None:
        with httpx.stream("GET", base + "/dashboard/feed", timeout=None) as resp:
            for _ in resp.iter_lines():
                if stop.is_set():
                    return

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=3)


def scrape(base: str) -> dict[str, float]:
    names = {
        "engine_thread": "poise:engine_thread_cpu_seconds",
        "loop_thread": "poise:event_loop_thread_cpu_seconds",
        "process": "process_cpu_seconds_total",
        "steps": "poise:step_duration_seconds_sum",
    }
    out = {}
    text = httpx.get(base + "/metrics", timeout=30).text
    for key, name in names.items():
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] = float(line.rsplit(" ", 1)[1])
    return out


def start_server(
    args: argparse.Namespace, port: int, kv_cache_dtype: str = "auto"
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "poise",
        "serve",
        *([args.model] if args.model else []),
        "--kv-cache-dtype",
        kv_cache_dtype,
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--served-model-name",
        "bench",
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--log-interval",
        "0",
        "--torch-threads",
        str(args.torch_threads),
    ]
    log = open(args.server_log, "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited; see {args.server_log}")
        time.sleep(0.25)
    raise SystemExit("server did not come up")


def report(cells: list[Cell]) -> str:
    rows = [
        "| conc | mode | req | out tok | s | tok/s | HTTP/offline | TTFT p50/p95 SHORT ms "
        "| TTFT p50/p95 LONG ms | server CPU s (engine / loop / process) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    offline = {c.concurrency: c for c in cells if c.mode == "offline"}

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    for cell in cells:
        ratio = ""
        if cell.mode.startswith("http") and cell.concurrency in offline:
            ratio = f"{cell.tokens_per_s / offline[cell.concurrency].tokens_per_s:.1%}"
        cpu = cell.server_cpu
        cpu_s = (
            (
                f"{cpu.get('engine_thread', 0):.1f} / {cpu.get('loop_thread', 0):.1f} / "
                f"{cpu.get('process', 0):.1f}"
            )
            if cpu
            else ""
        )
        rows.append(
            f"| {cell.concurrency} | {cell.mode} kv={cell.kv_cache_dtype} | {cell.num_requests} | {cell.output_tokens} "
            f"| {cell.seconds:.1f} | {cell.tokens_per_s:.1f} | {ratio} "
            f"| {f(cell.ttft_ms('short', 50))} / {f(cell.ttft_ms('short', 95))} "
            f"| {f(cell.ttft_ms('long', 50))} / {f(cell.ttft_ms('long', 95))} | {cpu_s} |"
        )
    return "\n".join(rows)


def run_server_cells(
    args: argparse.Namespace, port: int, kv: str, cells: list[Cell], LLM: Any
) -> int:
    """One server (and offline engine) with --kv-cache-dtype ``kv``: its cells appended to
    ``cells``; returns the server's exit code."""
    base = f"http://127.0.0.1:{port}"
    first = len(cells)
    proc = start_server(args, port, kv)
    try:
        llm = (
            None
            if args.no_offline
            else LLM(
                args.model,
                dtype=args.dtype,
                max_num_seqs=64,
                max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_dtype=kv,
            )
        )
        warm = [("short", SHORT_PROMPT)] * 2
        if llm is not None:
            run_offline(llm, warm, 2, 8)
        asyncio.run(run_http(base, "bench", warm, 2, 8))
        for c in args.concurrency:
            n = args.requests or args.waves * c
            reqs = workload(n, args.max_tokens, args.long_ratio, args.unique_long)
            if llm is not None and not args.http_first:
                cells.append(run_offline(llm, reqs, c, args.max_tokens))
            before = scrape(base)
            cell = asyncio.run(run_http(base, "bench", reqs, c, args.max_tokens))
            after = scrape(base)
            cell.server_cpu = {k: after[k] - before.get(k, 0.0) for k in after}
            cells.append(cell)
            if args.dashboard:
                # The first cell warmed the prefix cache; then warm cells alternate without and
                # with the page (A B A B) so neither side gets the cold start or the drift.
                cell.mode = "http (cold)"
                for paged in (False, True, False, True):
                    with page_reader(base) if paged else contextlib.nullcontext():
                        again = asyncio.run(run_http(base, "bench", reqs, c, args.max_tokens))
                    again.mode = "http+page" if paged else "http"
                    cells.append(again)
            if llm is not None and args.http_first:
                cells.append(run_offline(llm, reqs, c, args.max_tokens))
            for done in cells[first:]:
                done.kv_cache_dtype = kv
            print(report(cells[-2:]).splitlines()[-2:], file=sys.stderr, flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    pool = [ln for ln in Path(args.server_log).read_text().splitlines() if "KV pool:" in ln]
    print(f"kv_cache_dtype {kv}: {pool[-1] if pool else 'KV pool size not logged'}")
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="Default: the embedded SmolLM2-135M GGUF.")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--requests", type=int, default=0, help="Per cell (overrides --waves).")
    p.add_argument("--waves", type=int, default=1, help="Requests per cell = waves x concurrency.")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--long-ratio", type=float, default=0.25)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads for both the server and the offline engine.",
    )
    p.add_argument("--port", type=int, default=18777)
    p.add_argument("--server-log", default="/tmp/poise-bench-serving.log")
    p.add_argument("--http-first", action="store_true", help="Run HTTP before offline.")
    p.add_argument("--out", default=None, help="Write the cells as JSON here.")
    p.add_argument(
        "--dashboard",
        action="store_true",
        help="After each HTTP cell, run it four times more, alternately without and "
        "with a /dashboard/feed reader attached (mode http+page): the page's cost.",
    )
    p.add_argument("--no-offline", action="store_true", help="Skip the offline engine.")
    p.add_argument(
        "--unique-long", action="store_true", help="Every LONG prompt distinct (no shared prefix)."
    )
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        help="One server per value, in turn (e.g. auto int8).",
    )
    args = p.parse_args()

    import torch

    from poise.engine.llm import LLM
    from poise.serving.server import free_port

    torch.set_num_threads(args.torch_threads)

    port = args.port or free_port()
    cells: list[Cell] = []
    rcs = []
    for kv in args.kv_cache_dtype:
        rcs.append(run_server_cells(args, port, kv, cells, LLM))
    print(f"torch threads: {args.torch_threads}; cores: {os.cpu_count()}; server exit {rcs}")
    print(report(cells))
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(c) for c in cells], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
