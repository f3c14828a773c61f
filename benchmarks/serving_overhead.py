"""What the HTTP side costs per token: the server with a zero-cost model, at full speed.

Starts ``poise serve``'s app in a subprocess around the real EngineCore, scheduler and
AsyncEngine but a model that costs nothing (it "samples" a fixed token), with the real SmolLM2
tokenizer, then streams the seed's SHORT chat request (``ignore_eos``, 160 tokens) at each
concurrency from this process. Because the model is free, the tokens/s measured here is the
ceiling the HTTP side (event loop: SSE, detokenization, pydantic) plus the engine thread's own
Python (scheduling, delta routing) can carry, and the per-thread CPU from /metrics says which
side would saturate first. docs/serving.md uses it to decide thread vs process for the engine.

    .venv/bin/python benchmarks/serving_overhead.py [--concurrency 8 32 64] [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_http import run_http, scrape  # noqa: E402 - sibling script

from poise.core.outputs import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from poise.workload import SHORT_PROMPT  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class FreeExecutor:
    """Samples token 1000 + position % 500 for every request: no compute at all."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            {s.request_id: 1000 + (s.start_position % 500) for s in out.scheduled if s.sample}
        )


def serve_fake(port: int) -> int:
    from poise.config import EngineConfig
    from poise.engine.core import EngineCore
    from poise.serving.server import ServerSettings, build_state, serve
    from poise.text import eos_token_ids, load_tokenizer

    tok: Any = load_tokenizer(None)
    cfg = EngineConfig.from_kwargs(max_num_seqs=128, max_num_batched_tokens=8192)
    core = EngineCore(
        cfg,
        FreeExecutor(),
        num_kv_blocks=16384,
        max_model_len=8192,
        vocab_size=len(tok),
        eos_token_ids=eos_token_ids(tok),
    )
    settings = ServerSettings(port=port, log_interval_s=0)
    state = build_state(core, tok, model_name="bench", vocab_size=len(tok), settings=settings)
    return serve(state, settings)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--requests", type=int, default=0, help="Per cell; default 2 x concurrency.")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--port", type=int, default=18778)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve_fake(args.port)
    base = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, __file__, "--serve", "--port", str(args.port)]
    proc = subprocess.Popen(cmd, cwd=REPO)
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        asyncio.run(run_http(base, "bench", [("short", SHORT_PROMPT)] * 4, 4, 8))
        print(
            "| conc | tok/s | loop CPU us/token | engine-thread CPU us/token | process CPU s "
            "| wall s |\n|---|---|---|---|---|---|"
        )
        for c in args.concurrency:
            reqs = [("short", SHORT_PROMPT)] * (args.requests or 2 * c)
            before = scrape(base)
            cell = asyncio.run(run_http(base, "bench", reqs, c, args.max_tokens))
            after = scrape(base)
            d = {k: after[k] - before.get(k, 0.0) for k in after}
            n = cell.output_tokens
            print(
                f"| {c} | {cell.tokens_per_s:.0f} | {1e6 * d['loop_thread'] / n:.0f} "
                f"| {1e6 * d['engine_thread'] / n:.0f} | {d['process']:.1f} "
                f"| {cell.seconds:.1f} |",
                flush=True,
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
