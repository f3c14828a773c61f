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

``--runs N``: everything N times, each on freshly started servers (issue 33: the slowest of
three fresh runs), then per cell the spread of output tok/s, the worst TTFT p95 and the slowest
and fastest runs' server steps (mean step ms and steps per output token, from /metrics: slower
steps or more of them).

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
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from serving_http import page_reader, run_http, scrape, start_server
from serving_report import Cell, report, spread

from poise.core.sampling_params import SamplingParams
from poise.core.timing import derive
from poise.workload import SHORT_PROMPT, long_positions, seed_classes


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


def run_server_cells(
    args: argparse.Namespace, port: int, kv: str, cells: list[Cell], LLM: Any, run: int = 0
) -> int:
    """One server (and offline engine) with --kv-cache-dtype ``kv``, the ``run``-th of --runs:
    its cells appended to ``cells``; returns the server's exit code."""
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
                done.kv_cache_dtype, done.run = kv, run
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
        default=0,
        help="torch threads for both the server and the offline engine (default 0: the "
        "server's own default, torch's choice: every core).",
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
        "--runs",
        type=int,
        default=1,
        help="Repeat everything on freshly started servers; then the spread per cell.",
    )
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

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)

    port = args.port or free_port()
    cells: list[Cell] = []
    rcs = []
    for run in range(args.runs):
        for kv in args.kv_cache_dtype:
            rcs.append(run_server_cells(args, port, kv, cells, LLM, run))
    threads = args.torch_threads or torch.get_num_threads()
    print(f"torch threads: {threads}; cores: {os.cpu_count()}; server exit {rcs}")
    print(report(cells))
    if args.runs > 1:
        print(spread(cells))
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(c) for c in cells], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
