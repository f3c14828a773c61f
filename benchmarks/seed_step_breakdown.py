"""Where a decode step of the seed mix goes (step_breakdown.py's parts: attention, linears,
norms/rope/act, lm_head, sampling, inputs, host), with the decode kernel's shared-prefix
(cascade) groups off and on, through the real ``ModelRunner.execute``.

The rows are cascade_attention.py's: at concurrency C, C / 4 LONG rows (3,363 prompt tokens,
the same text: their first 210 blocks shared, as the prefix cache holds them) and 3C / 4 SHORT
rows (45 tokens, one prompt: two blocks shared), all sharing the first block, each ``--decoded``
tokens into its output. No prefill runs (the runner keeps no per-request state: decoding at a
position reads the pool there at the cost of a real context of that length). Embedded
SmolLM2-135M, bf16, torch's threads unless ``--threads``.

    .venv/bin/python benchmarks/seed_step_breakdown.py [--concurrency 8 16 32] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI sets it, before torch loads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from cascade_attention import LONG, SHORT, tables  # noqa: E402
from engine_steps import greedy  # noqa: E402
from step_breakdown import PARTS, instrumented  # noqa: E402

from poise.config import EngineConfig  # noqa: E402
from poise.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from poise.model.attention import CpuPagedAttentionBackend  # noqa: E402
from poise.runner.factory import create_model_runner  # noqa: E402
from poise.runner.model_runner import ModelRunner  # noqa: E402


def steps_of(
    runner: ModelRunner, rows: list[list[int]], prompts: list[int], decoded: int, steps: int
) -> list[tuple[float, dict[str, float]]]:
    """``steps`` decode steps of every row from ``decoded`` tokens on: (wall s, parts) each
    (parts empty unless the runner is instrumented by the caller)."""
    params = greedy(decoded + steps + 1)
    last = dict.fromkeys(range(len(rows)), 11)
    out = []
    for s in range(steps):
        reqs = [
            ScheduledRequest(
                f"r{i}",
                [last[i]],
                prompts[i] + decoded + s,
                rows[i],
                True,
                params,
                decoded + s,
                prompts[i],
            )
            for i in range(len(rows))
        ]
        start = time.perf_counter()
        result = runner.execute(SchedulerOutput(step_id=s + 1, scheduled=reqs))
        out.append((time.perf_counter() - start, {}))
        last = {int(k[1:]): v for k, v in result.sampled_token_ids.items()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--decoded", type=int, default=80)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    span = args.decoded + 3 * args.steps + 2
    layouts = {c: tables(c, span, shared_long=True) for c in args.concurrency}
    blocks = max(max(max(t) for t in rows) for rows, _ in layouts.values()) + 1
    config = EngineConfig.from_kwargs(
        dtype="bfloat16", num_kv_blocks=blocks, block_size=16, max_model_len=LONG + span + 32
    )
    runner, _ = create_model_runner(config)
    assert isinstance(runner.attention, CpuPagedAttentionBackend)
    print(f"load {os.getloadavg()[0]:.2f} (1 min); torch threads {torch.get_num_threads()}")
    header = " | ".join(PARTS)
    print(f"| conc | cascade | step ms (no timers) | step ms (timed) | {header} |")
    print("|---|---|---|---|" + "---|" * len(PARTS))
    for c, (rows, _) in layouts.items():
        prompts = [LONG if i % 4 == 0 else SHORT for i in range(c)]
        for cascade in (False, True):
            runner.attention.cascade = cascade
            steps_of(runner, rows, prompts, args.decoded, 2)  # warm
            plain = [t for t, _ in steps_of(runner, rows, prompts, args.decoded, args.steps)]
            timed = []
            with instrumented(runner) as ranges:
                for s in range(args.steps):
                    [(total, _)] = steps_of(runner, rows, prompts, args.decoded + s, 1)
                    parts = ranges.take()
                    parts["host"] = total - sum(parts.values())
                    timed.append((total, parts))
            timed.sort(key=lambda item: item[0])
            total, parts = timed[len(timed) // 2]
            cells = " | ".join(f"{1e3 * parts.get(name, 0.0):.1f}" for name in PARTS)
            print(
                f"| {c} | {'on' if cascade else 'off'} | {1e3 * statistics.median(plain):.1f} "
                f"| {1e3 * total:.1f} | {cells} |",
                flush=True,
            )
    print(f"load {os.getloadavg()[0]:.2f} (1 min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
