"""Decode step time on the CPU: the eager layer stack vs the same layers through torch.compile
(inductor), the attention backend left eager (a graph break around its kernel call).

    .venv/bin/python benchmarks/compiled_layers.py [--model PATH] [--dtype float32] [--steps 10]

Each step is timed end to end through ``ModelRunner.execute`` (best of ``--steps``) at batch
1 / 8 / 32 after a 16-token prefill; the compiled run first runs a few steps untimed (its
compiles). The question it answers: does compiling the decoder layers make the CPU path
faster (then it would be worth turning on), or not.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from poise.config import EngineConfig  # noqa: E402
from poise.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from poise.core.sampling_params import SamplingParams  # noqa: E402
from poise.runner.factory import create_model_runner  # noqa: E402
from poise.runner.model_runner import ModelRunner  # noqa: E402

BLOCK = 16


def step_times(runner: ModelRunner, batch: int, steps: int, warm: int) -> float:
    """Best seconds per decode step of ``batch`` requests; the first ``warm`` not counted."""
    sp = SamplingParams(temperature=0.0, max_tokens=steps + warm + 2)
    per = -(-(16 + steps + warm + 3) // BLOCK)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    reqs = [
        ScheduledRequest(
            f"r{i}", [(5 * i + j) % 400 + 3 for j in range(16)], 0, tables[i], True, sp, 0, 16
        )
        for i in range(batch)
    ]
    last = runner.execute(SchedulerOutput(step_id=0, scheduled=reqs)).sampled_token_ids
    best = float("inf")
    for s in range(steps + warm):
        reqs = [
            ScheduledRequest(f"r{i}", [last[f"r{i}"]], 16 + s, tables[i], True, sp, s + 1, 16)
            for i in range(batch)
        ]
        start = time.perf_counter()
        last = runner.execute(SchedulerOutput(step_id=s + 1, scheduled=reqs)).sampled_token_ids
        if s >= warm:
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    config = EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, num_kv_blocks=256, block_size=BLOCK
    )
    runner, info = create_model_runner(config)
    print(
        f"{info.model_name} {info.dtype} attention={info.attention_backend} "
        f"threads={torch.get_num_threads()}"
    )
    eager = {b: step_times(runner, b, args.steps, 2) for b in (1, 8, 32)}
    for layer in runner.model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=False)  # type: ignore[method-assign]
    compiled = {b: step_times(runner, b, args.steps, 3) for b in (1, 8, 32)}
    print("batch | eager ms | compiled ms | compiled / eager")
    for b in eager:
        print(
            f"{b:5d} | {eager[b] * 1e3:8.2f} | {compiled[b] * 1e3:11.2f} | "
            f"{compiled[b] / eager[b]:.2f}"
        )


if __name__ == "__main__":
    main()
