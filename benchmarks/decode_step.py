"""Decode step time of poise vs the floor of its own linear layers (same run, same dtype).

32 short requests are prefilled, then decode together; each step is timed end to end through
``ModelRunner.execute`` (input building, forward, paged attention, logits, sampling). The
floor is the model's matmuls alone at batch 32 (every q/k/v, o, gate/up, down projection and
the lm_head, with the model's own weights): no framework can do a step faster than that.

    .venv/bin/python benchmarks/decode_step.py [--model PATH] [--steps 20] [--threads N]

Timings are the best of ``--steps`` repeats, in wall and in process-CPU time (the steadier
one on a machine shared with other work). ``--threads 1`` gives the most repeatable numbers
on a busy 2-core box.
"""

from __future__ import annotations

import argparse
import os
import time

# As poise.runner does for the CLI: OpenMP reads this once, when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from poise.config import EngineConfig  # noqa: E402
from poise.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from poise.core.sampling_params import SamplingParams  # noqa: E402
from poise.model.llama import Linear  # noqa: E402
from poise.runner.factory import create_model_runner  # noqa: E402
from poise.runner.model_runner import ModelRunner  # noqa: E402

BATCH, BLOCK = 32, 16


class Timer:
    """Wall and process-CPU seconds of a block. On a shared machine CPU time is the steadier
    measure of work (wall time includes waiting for a core); with one thread they agree when
    the machine is idle."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def best_pair(timers: list[Timer]) -> tuple[float, float]:
    return min(t.wall for t in timers), min(t.cpu for t in timers)


def linear_floor(runner: ModelRunner, steps: int) -> tuple[float, float]:
    """Best (wall, cpu) seconds for all of the model's matmuls at batch BATCH."""
    model = runner.model
    weights = [m.weight for m in model.modules() if isinstance(m, Linear)]
    head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    weights.append(head)
    dtype = head.dtype
    inputs = {w.shape[1]: torch.randn(BATCH, w.shape[1], dtype=dtype) for w in weights}
    timers = []
    with torch.inference_mode():
        for _ in range(steps + 2):
            with Timer() as t:
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)
            timers.append(t)
    return best_pair(timers[2:])


def decode_steps(runner: ModelRunner, steps: int, prompt_len: int) -> tuple[float, float]:
    """Best (wall, cpu) seconds per decode step of BATCH requests (after a prefill)."""
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 1)
    blocks_per = (prompt_len + steps + 2 + BLOCK - 1) // BLOCK
    tables = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(BATCH)]
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(BATCH)]
    reqs = [
        ScheduledRequest(f"r{i}", prompts[i], 0, tables[i], True, sp, 0, prompt_len)
        for i in range(BATCH)
    ]
    last = runner.execute(SchedulerOutput(step_id=0, scheduled=reqs)).sampled_token_ids
    timers = []
    for s in range(steps + 2):
        pos = prompt_len + s
        reqs = [
            ScheduledRequest(f"r{i}", [last[f"r{i}"]], pos, tables[i], True, sp, s + 1, prompt_len)
            for i in range(BATCH)
        ]
        with Timer() as t:
            out = runner.execute(SchedulerOutput(step_id=s + 1, scheduled=reqs))
        last = out.sampled_token_ids
        timers.append(t)
    return best_pair(timers[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--prompt-len", type=int, default=16, help="context each request decodes against"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"batch {BATCH}, prompt {args.prompt_len}, threads {torch.get_num_threads()}")
    print(f"{'':>9} {'---------- wall ----------':>28} {'---------- cpu -----------':>28}")
    header = f"{'step ms':>9} {'floor ms':>9} {'ratio':>8}"
    print(f"{'dtype':>9} {header} {header} {'tok/s':>8}")
    for dtype in args.dtypes.split(","):
        config = EngineConfig.from_kwargs(
            model=args.model,
            dtype=dtype,
            num_kv_blocks=BATCH * ((args.prompt_len + args.steps + 2) // BLOCK + 2),
            block_size=BLOCK,
        )
        runner, _ = create_model_runner(config)
        floor_a = linear_floor(runner, args.steps)
        step = decode_steps(runner, args.steps, args.prompt_len)
        floor_b = linear_floor(runner, args.steps)  # bracket the step timing
        floor = (min(floor_a[0], floor_b[0]), min(floor_a[1], floor_b[1]))
        cols = [
            f"{step[i] * 1e3:9.2f} {floor[i] * 1e3:9.2f} {step[i] / floor[i]:8.2f}" for i in (0, 1)
        ]
        print(f"{dtype:>9} {cols[0]} {cols[1]} {BATCH / step[0]:8.0f}")


if __name__ == "__main__":
    main()
