"""Fused bfloat16 elementwise ops on CPU (cpu_elementwise.cpp): build, load, call.

``rms_norm`` (optionally after the residual add) and ``silu_mul`` for llama.py's RMSNorm and
MLP, ``rope`` for rope.py's rotation. Used only for bfloat16 tensors on CPU whose rows are contiguous; float32 keeps torch's
ops (bit-identical to transformers there), and without a compiler (or with
``POISE_DISABLE_CPU_KERNEL``) everything stays on torch. Measured in benchmarks/RESULTS.md
("Cold prefill of one long prompt").
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from poise.model.cpu_build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu_elementwise.cpp"
HEADERS = [
    *(
        Path(__file__).parent / "attention" / name
        for name in ("cpu_attention_common.h", "cpu_attention_avx2.h")
    ),
    Path(__file__).parent / "cpu_pool.h",
]
_FALLBACK = "RMSNorm and SiLU use torch's ops"


@functools.cache
def load_elementwise_kernel() -> Any:
    """The loaded library (its two entry points typed), building it on first use; None where
    it cannot be built."""
    import torch  # noqa: F401  (first: the library must bind to torch's libgomp)

    lib = load_library("cpu_elementwise", [SOURCE], HEADERS, _FALLBACK)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.poise_rms_norm_bf16.argtypes = [
        ptr,
        i64,  # x, its row stride
        ptr,
        i64,  # delta (or null), its row stride
        ptr,  # weight [dim]
        ptr,
        i64,  # out, its row stride
        i64,
        i64,
        ctypes.c_float,
        ctypes.c_int,  # rows, dim, eps, threads
    ]
    lib.poise_silu_mul_bf16.argtypes = [ptr, i64, ptr, i64, i64, i64, ctypes.c_int]
    lib.poise_rope_bf16.argtypes = [
        ptr,
        i64,
        i64,
        ctypes.c_int,
        ctypes.c_int,  # x, token and head strides, heads, hd
        ptr,
        ptr,
        i64,
        i64,
        ctypes.c_int,  # cos, sin, their row stride, tokens, threads
    ]
    for fn in (lib.poise_rms_norm_bf16, lib.poise_silu_mul_bf16, lib.poise_rope_bf16):
        fn.restype = ctypes.c_int
    return lib


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these: bfloat16 on CPU, rows (2-D) or a weight (1-D), each
    contiguous along its last dimension."""
    return all(
        t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.dim() <= 2 and t.stride(-1) == 1
        for t in tensors
    ) and (load_elementwise_kernel() is not None)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """norm(x) * weight [rows, dim] bf16; with ``delta``, x += delta first, IN PLACE."""
    lib = load_elementwise_kernel()
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=x.dtype)
    rc = lib.poise_rms_norm_bf16(
        x.data_ptr(),
        x.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        rows,
        dim,
        eps,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"rms_norm kernel rejected shape [{rows}, {dim}]")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2n] bf16 (gate, then up) -> silu(gate) * up [rows, n]."""
    lib = load_elementwise_kernel()
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype)
    rc = lib.poise_silu_mul_bf16(
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
        out.stride(0),
        rows,
        n,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"silu_mul kernel rejected shape [{rows}, {width}]")
    return out


def rope_applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rope`` takes these: bf16 on CPU, x [T, heads, hd] with contiguous heads, the
    tables [T, 1, hd] with contiguous rows."""
    return (
        x.dim() == 3
        and x.stride(2) == 1
        and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])
        and cos.stride() == sin.stride()
        and cos.stride(2) == 1
        and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in (x, cos, sin))
        and load_elementwise_kernel() is not None
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, hd] in place by the tables [T, 1, hd] (see rope.RotaryEmbedding)."""
    lib = load_elementwise_kernel()
    tokens, heads, hd = x.shape
    rc = lib.poise_rope_bf16(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        heads,
        hd,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        tokens,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"rope kernel rejected shape [{tokens}, {heads}, {hd}]")


if __name__ == "__main__":  # `python -m poise.model.elementwise`: build ahead of time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = load_elementwise_kernel() is not None
    print("elementwise kernel ready" if built else "elementwise kernel not built (see above)")
