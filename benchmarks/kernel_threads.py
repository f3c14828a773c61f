"""Decode steps with the kernels' items on the pool (model/cpu_pool.h) against an OpenMP region
per call, as before: the same runner, the modes alternated step by step in one process.

The decode-sized linear paths and the decode attention kernel hand their items to a pool whose
caller starts at once and whose helpers join while awake (spinning politely, ``sched_yield``,
for ``POISE_POOL_SPIN_US`` after a loop), instead of an OpenMP region that, with poise's
``OMP_WAIT_POLICY=PASSIVE``, wakes its sleeping worker at the start and sleeps at the end. The
peer is that OpenMP build of the same kernels (``linear_kernel.set_threading(openmp=True)``),
measured in the same rounds; also the pool with helpers asleep at once, and the caller alone.
``--busy N`` runs N busy-looping processes beside it (a shared machine), stopped at the end.

    .venv/bin/python benchmarks/kernel_threads.py [--batch 1 8 32] [--busy 0]
    .venv/bin/python benchmarks/kernel_threads.py --model dummy:benchmarks/shapes/smollm2-1.7b \
        --quantization int8 --batch 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI sets it, before torch loads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from engine_steps import DecodeBatch  # noqa: E402

from poise.config import EngineConfig  # noqa: E402
from poise.model import linear_kernel as lk  # noqa: E402
from poise.runner.factory import create_model_runner  # noqa: E402

# (name, openmp, spin_us)
MODES = [
    ("openmp (before)", True, lk.POOL_SPIN_US),
    ("pool", False, lk.POOL_SPIN_US),
    ("pool, helpers asleep", False, 0),
    ("caller alone", False, -1),
]


def measure(batch: DecodeBatch, rounds: int) -> dict[str, list[float]]:
    """Step seconds per mode, the modes alternated step by step."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in MODES}
    for _ in range(rounds):
        for name, openmp, spin in MODES:
            lk.set_threading(openmp=openmp, spin_us=spin)
            start = time.perf_counter()
            batch.step()
            times[name].append(time.perf_counter() - start)
    lk.set_threading()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--quantization", default=None, choices=[None, "int8", "int4"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=15, help="steps per mode and batch")
    p.add_argument("--context", type=int, default=64, help="prompt tokens before decoding")
    p.add_argument("--busy", type=int, default=0, help="busy-looping processes beside it")
    args = p.parse_args()
    steps = args.rounds * len(MODES) + 4
    config = EngineConfig.from_kwargs(
        model=args.model,
        dtype="bfloat16",
        quantization=args.quantization,
        num_kv_blocks=max(args.batch) * ((args.context + steps) // 16 + 2),
        block_size=16,
    )
    runner, _ = create_model_runner(config)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        print(f"threads {torch.get_num_threads()}, busy processes beside: {args.busy}")
        print("| batch | " + " | ".join(name for name, _, _ in MODES) + " | pool / openmp |")
        print("|---" * (len(MODES) + 2) + "|")
        for rows in args.batch:
            batch = DecodeBatch(runner, rows, args.context, steps)
            batch.prefill()
            for _ in range(2):  # warm: helpers started, caches touched
                batch.step()
            times = measure(batch, args.rounds)
            med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            cells = " | ".join(f"{med[name]:.1f} ms" for name, _, _ in MODES)
            ratio = med["pool"] / med["openmp (before)"]
            print(f"| {rows} | {cells} | {ratio:.2f} |", flush=True)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
