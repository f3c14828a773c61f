"""Resolving ``device="auto"`` and ``dtype="auto"`` for the machine the engine runs on.

dtype "auto": bfloat16 on CUDA (float16 where bf16 is unsupported); on CPU, bfloat16 when the
CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16: about twice float32's speed for the
weight matmuls, half the weight and KV memory) or has AVX2 + FMA and poise's kernels built
(their AVX2 build runs bf16 linear layers, attention and norms: the seed mix 1.8-2.2x
float32's output tok/s on a Zen 3, benchmarks/RESULTS.md "Attention on AVX2"), float32
elsewhere (where bf16 would be torch's emulated ops, slower than float32). Outputs then match
the float32 transformers reference only where float32 was picked; tests that compare to
transformers pin ``dtype="float32"``.
"""

from __future__ import annotations

import torch

from poise.model.cpu_build import AVX2_FLAGS, cpu_flags

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# /proc/cpuinfo flags of a native bf16 dot product (AVX512-BF16) or matrix unit (AMX).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when a CUDA device is present, else cpu; other names as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS)


def cpu_runs_bf16_fast(flags: frozenset[str] | None = None, kernels: bool | None = None) -> bool:
    """Whether bf16 beats float32 on this CPU: native bf16, or AVX2 + FMA with poise's linear
    kernel library built (``kernels``: None asks it, which builds it on first use)."""
    have = cpu_flags() if flags is None else flags
    if cpu_has_native_bf16(have):
        return True
    if not AVX2_FLAGS.issubset(have):
        return False
    if kernels is None:
        from poise.model.linear_kernel import load_linear_kernel

        kernels = load_linear_kernel() is not None
    return kernels


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_runs_bf16_fast() else torch.float32


# --kv-cache-dtype names -> storage dtypes ("fp8" is e4m3, vLLM's default fp8 format).
KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


# Backends that read the int8 cache (model/attention/kv_int8.py): the cpu kernels, and the
# torch reference (it dequantizes what it gathers). flex reads K/V in the model dtype.
INT8_KV_BACKENDS = ("cpu", "torch")


def resolve_kv_cache_dtype(
    name: str, device: torch.device, attention_backend: str, dtype: torch.dtype
) -> torch.dtype:
    """The KV cache's storage dtype: the model's for ``auto``; fp8 on CUDA with the torch
    backend (it widens what it gathers); int8 (``torch.int8``: the layout of kv_int8.py) on
    CPU with the cpu or torch backend; a clear error anywhere else, where it does not exist
    yet."""
    if name == "auto":
        return dtype
    if name == "int8":
        if device.type != "cpu":
            raise ValueError(
                f"kv_cache_dtype: 'int8' runs on CPU only, not {device.type}; on CUDA use "
                "kv_cache_dtype='fp8' (with attention_backend='torch') or 'auto'"
            )
        if attention_backend not in INT8_KV_BACKENDS:
            allowed = " or ".join(map(repr, INT8_KV_BACKENDS))
            raise ValueError(
                f"kv_cache_dtype: 'int8' runs with attention_backend {allowed}, not "
                f"{attention_backend!r} (it reads K/V in the model dtype)"
            )
        return torch.int8
    if device.type != "cuda":
        hint = (
            " (on CPU, kv_cache_dtype='int8' stores one byte per value)"
            if device.type == "cpu"
            else ""
        )
        raise ValueError(
            f"kv_cache_dtype: {name!r} runs on a CUDA device only, not {device.type}; "
            f"use kv_cache_dtype='auto'{hint}"
        )
    if attention_backend != "torch":
        raise ValueError(
            f"kv_cache_dtype: {name!r} runs with attention_backend='torch' only, not "
            f"{attention_backend!r} (it reads K/V in the model dtype)"
        )
    return KV_CACHE_DTYPES[name]
