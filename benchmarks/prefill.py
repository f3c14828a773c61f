"""Cold prefill of one long prompt: TTFT through the engine vs the model's own matmul time.

One request of the seed's LONG prompt (3,363 tokens with SmolLM2's chat template), alone on
the engine, ``max_tokens=1``: the time to its first token is the whole prefill (every chunk
of ``--max-num-batched-tokens``, default the engine's 2048) plus one sampling. It runs once
per attention backend, interleaved, so each backend sees the same machine load:

- ``cpu``: the C++ kernels (blocked prefill kernel for every chunk, reading K/V in place);
- ``torch``: the SDPA path (a later chunk gathers every earlier block and attends through a
  dense offset-causal mask).

The floor is the model's linear layers alone (q/k/v, o, gate/up, down, with its own
weights) over the same tokens in the same chunks, timed in the same run: no engine can
prefill faster than that. The figure to quote is TTFT / floor.

    .venv/bin/python benchmarks/prefill.py [--model PATH] [--repeats 5] [--threads 1] [--profile]

``--profile`` adds one more cold prefill per backend under the torch profiler and splits its
time: the linear layers (``aten::mm`` and poise's linear kernels, the lm_head's one row
included), the attention backend
(its K/V write and kernel), the other ops of the model (norms, rope, SiLU, residual adds,
embedding: torch's, or the fused bf16 kernels), and the rest (engine, Python, the profiler's
own cost).

Prefix caching is off so every repeat is cold. Medians of ``--repeats``, in wall and in
process-CPU seconds (the steadier one on a machine shared with other work).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import time
from typing import Any

# As poise.runner does for the CLI: OpenMP reads this once, when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from poise.core import SamplingParams  # noqa: E402
from poise.engine.llm import LLM  # noqa: E402
from poise.model.llama import Linear  # noqa: E402
from poise.workload import LONG_PROMPT  # noqa: E402

BACKENDS = ("cpu", "torch")


def timed(fn: object) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()  # type: ignore[operator]
    return time.perf_counter() - wall, time.process_time() - cpu


def linear_floor(llm: LLM, chunks: list[int]) -> tuple[float, float]:
    """(wall, cpu) seconds of every linear layer over the prompt, chunk by chunk."""
    model = llm.engine._executor.model  # type: ignore[attr-defined]
    # torch's GEMM on the plain [N, K] weights (bf16 layers on AMX hold them packed); the
    # decoder's layers only: the head runs on the sampled row alone (the engine's one row).
    weights = [m.dense_weight() for m in model.model.modules() if isinstance(m, Linear)]
    dtype = weights[0].dtype
    inputs = {
        (n, w.shape[1]): torch.randn(n, w.shape[1], dtype=dtype) for w in weights for n in chunks
    }

    def run() -> None:
        with torch.inference_mode():
            for n in chunks:
                for w in weights:
                    F.linear(inputs[(n, w.shape[1])], w)

    return timed(run)


def profile_breakdown(llm: LLM, tokens: list[int], params: SamplingParams) -> dict[str, float]:
    """Seconds of one cold prefill by part (see the module docstring), from the profiler's
    times on the engine thread (an op's own time, its threads included)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    runner: Any = llm.engine._executor  # type: ignore[attr-defined]
    backend = runner.attention
    forward = backend.forward

    def traced(*args: object) -> torch.Tensor:
        with record_function("attention"):
            return forward(*args)  # type: ignore[no-any-return]

    backend.forward = traced
    # The fused bf16 kernels are ctypes calls, not torch ops: labelled so that they count.
    elementwise: Any = None
    with contextlib.suppress(ImportError):  # (absent before them: older commits are measured too)
        elementwise = importlib.import_module("poise.model.elementwise")
    names = ("rms_norm", "silu_mul", "rope") if elementwise is not None else ()
    fused = {name: getattr(elementwise, name) for name in names}
    for name, fn in fused.items():
        setattr(elementwise, name, _labelled(fn, record_function))
    # So are poise's linear kernels (bf16 as stored, bf16 packed for AMX, int8 / int4).
    kernels = _linear_kernels()
    for owner, name, fn in kernels:
        setattr(owner, name, _labelled(fn, record_function, "linear kernel"))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall, _ = timed(lambda: llm.generate(tokens, params))
    finally:
        del backend.forward  # back to the class's method
        for name, fn in fused.items():
            setattr(elementwise, name, fn)
        for owner, name, fn in kernels:
            setattr(owner, name, fn)
    parts = {"linear layers": 0.0, "attention": 0.0, "other model ops": 0.0}
    for event in prof.key_averages():
        if event.key == "attention":
            parts["attention"] += event.cpu_time_total / 1e6
        elif event.key in ("aten::mm", "aten::addmm", "linear kernel"):
            parts["linear layers"] += event.self_cpu_time_total / 1e6
    ops = sum(
        e.self_cpu_time_total
        for e in prof.key_averages()
        if e.key.startswith("aten::") or e.key in ("fused elementwise", "linear kernel")
    )
    attention_ops = sum(
        e.self_cpu_time_total
        for e in prof.events()
        if e.key.startswith("aten::") and _inside(e, "attention")
    )
    parts["other model ops"] = ops / 1e6 - parts["linear layers"] - attention_ops / 1e6
    parts["engine, Python, profiler"] = wall - sum(parts.values())
    parts["total (TTFT)"] = wall
    return parts


def _labelled(fn: Any, record_function: Any, label: str = "fused elementwise") -> Any:
    def call(*args: object, **kwargs: object) -> object:
        with record_function(label):
            return fn(*args, **kwargs)

    return call


def _linear_kernels() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, function) of each linear-kernel entry the model calls (none before
    poise had them: older commits are measured too)."""
    found: list[tuple[Any, str, Any]] = []
    with contextlib.suppress(ImportError):
        llama = importlib.import_module("poise.model.llama")
        kernel = importlib.import_module("poise.model.linear_kernel")
        if hasattr(llama, "bf16_linear"):
            found.append((llama, "bf16_linear", llama.bf16_linear))
        for cls in ("PackedBf16", "PackedWeight"):
            if hasattr(kernel, cls):
                found.append((getattr(kernel, cls), "__call__", getattr(kernel, cls).__call__))
    return found


def _inside(event: object, name: str) -> bool:
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--profile", action="store_true", help="also split one prefill by op")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    backends = args.backends.split(",")
    llms = {
        name: LLM(
            model=args.model,
            dtype=args.dtype,
            attention_backend=name,
            enable_prefix_caching=False,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_kv_blocks=320,
            block_size=16,
        )
        for name in backends
    }
    first = llms[backends[0]]
    prompt = first.chat([{"role": "user", "content": LONG_PROMPT}], SamplingParams(max_tokens=1))
    tokens = prompt[0].prompt_token_ids
    n = len(tokens)
    budget = args.max_num_batched_tokens
    chunks = [min(budget, n - s) for s in range(0, n, budget)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    print(
        f"prompt {n} tokens in chunks {chunks}, {args.dtype}, threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus"
    )
    ttft: dict[str, list[tuple[float, float]]] = {b: [] for b in backends}
    floor: list[tuple[float, float]] = []
    for _ in range(args.repeats):  # interleaved: every backend and the floor each round
        for name in backends:
            ttft[name].append(timed(lambda llm=llms[name]: llm.generate(tokens, params)))
        floor.append(linear_floor(first, chunks))

    def med(xs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(x[i] for x in xs)

    fw, fc = med(floor, 0), med(floor, 1)
    print(f"{'':>8} {'wall s':>8} {'cpu s':>8} {'tok/s':>8} {'x floor':>8} {'x floor cpu':>12}")
    print(f"{'matmuls':>8} {fw:8.3f} {fc:8.3f} {n / fw:8.0f} {1.0:8.2f} {1.0:12.2f}")
    for name in backends:
        w, c = med(ttft[name], 0), med(ttft[name], 1)
        print(f"{name:>8} {w:8.3f} {c:8.3f} {n / w:8.0f} {w / fw:8.2f} {c / fc:12.2f}")
    if args.profile:
        for name in backends:
            parts = profile_breakdown(llms[name], tokens, params)
            print(f"{name}, one profiled prefill (wall s on the engine thread):")
            for part, seconds in parts.items():
                print(f"  {part:>26} {seconds:7.3f} {seconds / parts['total (TTFT)']:6.1%}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
