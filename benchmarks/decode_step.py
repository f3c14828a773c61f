"""Decode step time of poise vs the floor of its own linear layers (same run, same dtype).

``--batch`` (32) short requests are prefilled, then decode together; each step is timed end to end through
``ModelRunner.execute`` (input building, forward, paged attention, logits, sampling). The
floor is the model's matmuls alone at that batch (every q/k/v, o, gate/up, down projection and
the lm_head, with the model's own weights and layers: quantized ones under
``--quantizations``): no framework can do a step faster than that.

    .venv/bin/python benchmarks/decode_step.py [--model PATH] [--steps 20] [--threads N]
    .venv/bin/python benchmarks/decode_step.py --dtypes bfloat16 --quantizations none,int8,int4

Timings are the best of ``--steps`` repeats, in wall and in process-CPU time (the steadier
one on a machine shared with other work). ``--threads 1`` gives the most repeatable numbers
on a busy 2-core box.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

# As poise.runner does for the CLI: OpenMP reads this once, when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from engine_steps import (  # noqa: E402
    DecodeBatch,
    Timer,
    best_pair,
    in_features,
    projections,
    random_inputs,
)

from poise.config import EngineConfig  # noqa: E402
from poise.model.llama import Linear, project  # noqa: E402
from poise.runner.factory import create_model_runner  # noqa: E402
from poise.runner.model_runner import ModelRunner  # noqa: E402

BLOCK = 16
BATCH = 32  # --batch


def linear_floor(runner: ModelRunner, steps: int) -> tuple[float, float]:
    """Best (wall, cpu) seconds for all of the model's linear layers (as the model runs them:
    quantized or not) and the lm_head at batch BATCH."""
    model = runner.model
    layers = [m for _, m in projections(model)]
    head = model.lm_head if model.lm_head is not None else model.tied_head
    embed = model.model.embed_tokens.weight
    inputs = random_inputs({embed.shape[1], *map(in_features, layers)}, BATCH, embed.dtype)
    hidden = inputs[embed.shape[1]]
    timers = []
    with torch.inference_mode():
        for _ in range(steps + 2):
            with Timer() as t:
                for m in layers:
                    m(inputs[in_features(m)])
                if head is not None:
                    head(hidden)
                else:  # tied, unquantized: the embedding is the head
                    project(hidden, embed, None)
            timers.append(t)
    return best_pair(timers[2:])


def decode_steps(runner: ModelRunner, steps: int, prompt_len: int) -> tuple[float, float]:
    """Best (wall, cpu) seconds per decode step of BATCH requests (after a prefill)."""
    batch = DecodeBatch(runner, BATCH, prompt_len, steps + 2)
    batch.prefill()
    timers = []
    for _ in range(steps + 2):
        with Timer() as t:
            batch.step()
        timers.append(t)
    return best_pair(timers[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--quantizations", default="none", help="comma list of none, int8, int4 (--quantization)"
    )
    parser.add_argument("--batch", type=int, default=32, help="requests decoding together")
    parser.add_argument(
        "--floor-repeats", type=int, default=5, help="interleaved rounds comparing the floors"
    )
    parser.add_argument(
        "--fusion", action="store_true", help="also time fused q/k/v and gate/up vs split"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=16, help="context each request decodes against"
    )
    args = parser.parse_args()
    global BATCH
    BATCH = args.batch
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"batch {BATCH}, prompt {args.prompt_len}, threads {torch.get_num_threads()}")
    print(f"{'':>14} {'---------- wall ----------':>28} {'---------- cpu -----------':>28}")
    header = f"{'step ms':>9} {'floor ms':>9} {'ratio':>8}"
    print(f"{'dtype':>14} {header} {header} {'tok/s':>8}")
    settings = [(d, q) for d in args.dtypes.split(",") for q in args.quantizations.split(",")]
    runners: dict[str, ModelRunner] = {}
    for dtype, quantization in settings:
        config = EngineConfig.from_kwargs(
            model=args.model,
            dtype=dtype,
            quantization=None if quantization == "none" else quantization,
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
        name = dtype if quantization == "none" else f"{dtype} {quantization}"
        print(f"{name:>14} {cols[0]} {cols[1]} {BATCH / step[0]:8.0f}")
        runners[name] = runner
    if len(runners) > 1 and args.floor_repeats:
        compare_floors(runners, args.floor_repeats, args.steps)
    if args.fusion:
        for name, runner in runners.items():
            compare_fusion(name, runner, args.floor_repeats or 5, args.steps)


def _projections(module: torch.nn.Module, sizes: list[int]) -> list[Callable[[torch.Tensor], Any]]:
    """The fused projection's matmuls as the checkpoint's separate layers (row slices of the
    same weights, bf16 Linear layers)."""
    if isinstance(module, Linear):
        return [lambda x, w=w: project(x, w, None) for w in module.dense_weight().split(sizes)]
    raise ValueError(f"no split form for {type(module).__name__} (bf16 layers only)")


def compare_fusion(name: str, runner: ModelRunner, repeats: int, steps: int) -> None:
    """q/k/v in one matmul and gate/up in one (as the model runs them) against the same
    weights as the checkpoint's five matmuls per layer, at batch BATCH, interleaved rounds."""
    model, a = runner.model, runner.model.arch
    dtype = model.model.embed_tokens.weight.dtype
    x = torch.randn(BATCH, a.hidden_size, dtype=dtype)
    fused, split = [], []
    for layer in model.model.layers:
        qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        fused += [qkv, gate_up]
        split += _projections(qkv, [a.q_size, a.kv_size, a.kv_size])
        split += _projections(gate_up, [a.intermediate_size] * 2)
    cpu: dict[str, list[float]] = {"fused": [], "split": []}
    with torch.inference_mode():
        for _ in range(repeats):
            for label, calls in (("fused", fused), ("split", split)):
                timers = []
                for _ in range(steps + 2):
                    with Timer() as t:
                        for call in calls:
                            call(x)
                    timers.append(t)
                cpu[label].append(best_pair(timers[2:])[1])
    f, s = (statistics.median(cpu[k]) for k in ("fused", "split"))
    print(
        f"{name}: q/k/v + gate/up projections at batch {BATCH}, CPU ms (median of {repeats}): "
        f"fused {f * 1e3:.2f}, split {s * 1e3:.2f}, split / fused {s / f:.2f}"
    )


def compare_floors(runners: dict[str, ModelRunner], repeats: int, steps: int) -> None:
    """The linear floors of every setting, interleaved (a round of each setting, ``repeats``
    rounds) so a busy machine's drift hits all alike; medians of the rounds' best-of-steps CPU
    times, and each setting's ratio to the first."""
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            cpu[name].append(linear_floor(runner, steps)[1])
    first = statistics.median(next(iter(cpu.values())))
    print(f"linear floor at batch {BATCH}, CPU ms, {repeats} interleaved rounds:")
    for name, times in cpu.items():
        med = statistics.median(times)
        rounds = " ".join(f"{t * 1e3:.1f}" for t in times)
        print(
            f"{name:>14} median {med * 1e3:8.2f}  speedup vs first {first / med:5.2f}x  ({rounds})"
        )


if __name__ == "__main__":
    main()
