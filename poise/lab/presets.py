"""Built-in sweep presets: the seed lab's three configs (doc 004), scaled to the machine.

The lab (a GPU, Qwen2.5-7B-Instruct):
  A conservative  max-num-seqs 16, max-num-batched-tokens 4096, max-model-len 4096, memory 0.85
  B throughput    max-num-seqs 64, max-num-batched-tokens 8192, max-model-len 4096, memory 0.90
  C long prompts  max-num-seqs 64, max-num-batched-tokens 8192, max-model-len 8192, chunked
  workload: concurrency 8/16/32/64 x long ratio 0/0.25/0.5, max_tokens 160, long prompt =
  the seed's log line x 220 (~3.3k tokens).

On a GPU (``device`` cuda...) the numbers are the lab's; the memory fraction is
``gpu_memory_utilization``. On CPU, so the lab finishes in minutes on 2 cores, every size is
divided by ``scale`` (default 8), with floors that keep each config able to serve the scaled
prompts:
  - request caps, token budgets, max-model-len, client concurrency, max_tokens and the long
    prompt's repeat count: / scale (A: 2 seqs, 512 tokens, len 512; B: 8, 1024, 512;
    C: 8, 1024, len 1024; clients 2/4 (lab 8..64 -> 1..8, the two middle ones); long ratio 0
    and 0.5; max_tokens 20; long prompt x 27 lines, ~400 tokens);
  - the KV budget: the engine's own CPU rule, the memory fraction of a byte base
    (``gpu_memory_utilization = fraction``, ``kv_cache_memory_base = kv_base_bytes``, default
    512 MiB: 0.85 -> 435 MiB, 0.90 -> 461 MiB; ``CacheConfig.cpu_kv_budget_bytes``), since a
    CPU has no device memory to take a fraction of.
A and B run without chunked prefill (the lab turns it on for C only); their token budget is at
least their max-model-len, so every admissible prompt still fits one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from poise.bench.bench_config import WorkloadSpec
from poise.workload import SEED_LONG_REPEAT

MiB = 1 << 20
DEFAULT_KV_BASE_BYTES = 512 * MiB
DEFAULT_CPU_SCALE = 8


@dataclass(frozen=True)
class LabConfig:
    name: str
    description: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    memory_fraction: float
    chunked_prefill: bool
    scheduling_policy: str = "fifo"


LAB_A = LabConfig("A-conservative", "latency-first start", 16, 4096, 4096, 0.85, False)
LAB_B = LabConfig("B-throughput", "bigger batches and budget", 64, 8192, 4096, 0.90, False)
LAB_C = LabConfig("C-long-prompts", "long context, chunked prefill", 64, 8192, 8192, 0.90, True)
LAB_C_PF = replace(
    LAB_C,
    name="C-prefill-first",
    description="C with prefill-first",
    scheduling_policy="prefill_first",
)

PRESETS: dict[str, tuple[str, tuple[LabConfig, ...]]] = {
    "lab": ("the seed lab's three configs A, B, C", (LAB_A, LAB_B, LAB_C)),
    "policy": ("C under FIFO vs prefill-first (what each sacrifices)", (LAB_C, LAB_C_PF)),
}

LAB_WORKLOAD = WorkloadSpec(
    concurrency=(8, 16, 32, 64), long_ratio=(0.0, 0.25, 0.5), max_tokens=160
)


@dataclass(frozen=True)
class PresetPlan:
    name: str
    configs: list[dict[str, Any]]  # spec dicts for sweep.spec_from_dict
    workload: WorkloadSpec
    notes: list[str] = field(default_factory=list)


def is_gpu(device: str) -> bool:
    return device.startswith("cuda")


def scaled_args(c: LabConfig, device: str, scale: int, kv_base_bytes: int) -> dict[str, Any]:
    args: dict[str, Any] = {
        "scheduling_policy": c.scheduling_policy,
        "enable_chunked_prefill": c.chunked_prefill,
    }
    if device != "cpu":
        args["device"] = device
    if is_gpu(device):
        args.update(
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=c.max_model_len,
            gpu_memory_utilization=c.memory_fraction,
        )
        return args
    model_len = max(256, c.max_model_len // scale)
    budget = max(256, c.max_num_batched_tokens // scale)
    if not c.chunked_prefill:
        budget = max(budget, model_len)  # a whole prompt must fit one step
    args.update(
        max_num_seqs=max(1, c.max_num_seqs // scale),
        max_num_batched_tokens=budget,
        max_model_len=model_len,
        gpu_memory_utilization=c.memory_fraction,
        kv_cache_memory_base=kv_base_bytes,
    )
    return args


def scaled_workload(device: str, scale: int) -> WorkloadSpec:
    if is_gpu(device):
        return LAB_WORKLOAD
    return WorkloadSpec(
        concurrency=(max(1, 16 // scale), max(1, 32 // scale)),
        long_ratio=(0.0, 0.5),
        max_tokens=max(8, LAB_WORKLOAD.max_tokens // scale),
        num_requests=8,
        warmup=2,
        long_repeat=max(1, SEED_LONG_REPEAT // scale),
    )


def plan(
    name: str,
    *,
    device: str = "cpu",
    scale: int | None = None,
    kv_base_bytes: int = DEFAULT_KV_BASE_BYTES,
    model: str | None = None,
) -> PresetPlan:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    scale = scale or (1 if is_gpu(device) else DEFAULT_CPU_SCALE)
    _, configs = PRESETS[name]
    specs = [
        {"name": c.name, "model": model, "args": scaled_args(c, device, scale, kv_base_bytes)}
        for c in configs
    ]
    notes = [f"preset {name}: {PRESETS[name][0]}"]
    if not is_gpu(device):
        notes.append(
            f"CPU scaling: sizes / {scale}, KV budget = memory fraction x "
            f"{kv_base_bytes // MiB} MiB (see docs/tuning.md)"
        )
    return PresetPlan(name, specs, scaled_workload(device, scale), notes)
