"""Named accelerators for the roofline cost model: peak dense 16-bit tensor FLOP/s, memory
bandwidth and memory size, from the vendors' public data sheets.

Invariants: peaks are *dense* (no 2:4 sparsity) bf16/fp16 tensor-core numbers for the SXM / PCIe
part named; memory sizes are in bytes as marketed (GB = 1e9). The roofline model applies its own
efficiency factors on top: these are ceilings, never expected values.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    description: str = ""


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("a10", 125 * TFLOPS, 600 * GB, 24 * GB, "NVIDIA A10 24GB (PCIe)"),
        Accelerator("l40s", 362 * TFLOPS, 864 * GB, 48 * GB, "NVIDIA L40S 48GB"),
        Accelerator("a100-40gb", 312 * TFLOPS, 1555 * GB, 40 * GB, "NVIDIA A100 40GB SXM"),
        Accelerator("a100", 312 * TFLOPS, 2039 * GB, 80 * GB, "NVIDIA A100 80GB SXM"),
        Accelerator("h100", 989 * TFLOPS, 3350 * GB, 80 * GB, "NVIDIA H100 80GB SXM"),
        Accelerator("h200", 989 * TFLOPS, 4800 * GB, 141 * GB, "NVIDIA H200 141GB SXM"),
    )
}

# Other spellings people use for the same parts.
_ALIASES: dict[str, str] = {
    "a10g": "a10",
    "a10-24gb": "a10",
    "l40s-48gb": "l40s",
    "a100-80gb": "a100",
    "a100-sxm": "a100",
    "h100-80gb": "h100",
    "h100-sxm": "h100",
    "h200-141gb": "h200",
}


def get_accelerator(name: str) -> Accelerator:
    key = name.lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise ValueError(f"accelerator: unknown {name!r}; known: {sorted(ACCELERATORS)}")
    return ACCELERATORS[key]
