"""The C++ weight-only int8 linear kernel (cpu_int8_linear.cpp): build, load, pack, call.

Used by ``Int8Linear`` for bfloat16 models on CPUs with AVX512-BF16 (the kernel's
instructions); elsewhere, or without a compiler, Int8Linear runs torch's
``_weight_int8pack_mm``. Measured in benchmarks/RESULTS.md ("Quantized weights").
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from poise.model.cpu_build import build_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu_int8_linear.cpp"
_FALLBACK = "int8 layers use torch's _weight_int8pack_mm"
# Output channels per vector and inputs per pair: the packed layout's granularity.
TILE, PAIR = 16, 2


def _has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@functools.cache
def load_int8_kernel() -> Any:
    """The kernel's entry point (a ctypes function), building it on first use; None where it
    cannot run."""
    import torch  # noqa: F401  (first: the library must bind to torch's libgomp)

    if not _has_avx512_bf16():
        logger.info("no AVX512-BF16: %s", _FALLBACK)
        return None
    target = build_library("cpu_int8_linear", [SOURCE], [], _FALLBACK)
    if target is None:
        return None
    try:
        fn = ctypes.CDLL(str(target)).poise_int8_linear
    except OSError as exc:
        logger.warning("int8 kernel unavailable (%s): %s", exc, _FALLBACK)
        return None
    fn.argtypes = [
        ctypes.c_void_p,  # x [m, k] bf16
        ctypes.c_int64,  # m
        ctypes.c_int64,  # k
        ctypes.c_void_p,  # packed weight
        ctypes.c_void_p,  # scale [n] float32
        ctypes.c_int64,  # n
        ctypes.c_void_p,  # y [m, n] bf16
        ctypes.c_int,  # threads
    ]
    fn.restype = ctypes.c_int
    return fn


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % PAIR == 0


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's [N/16, K/2, 16, 2] (16 channels x 2 inputs per 32 bytes)."""
    n, k = q.shape
    return q.reshape(n // TILE, TILE, k // PAIR, PAIR).permute(0, 2, 1, 3).contiguous()


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 (contiguous) @ the packed int8 weight, times scale [N] float32 -> bf16."""
    fn = load_int8_kernel()
    assert fn is not None, "int8_linear needs the kernel (load_int8_kernel())"
    m, k = x.shape
    n = packed.shape[0] * TILE
    y = torch.empty(m, n, dtype=torch.bfloat16)
    rc = fn(x.data_ptr(), m, k, packed.data_ptr(), scale.data_ptr(), n, y.data_ptr(),
            torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"int8 kernel: shape [{m}, {k}] x [{n}, {k}] does not fit its packing")
    return y


if __name__ == "__main__":  # `python -m poise.model.quant_kernel`: build ahead of time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("int8 kernel ready" if load_int8_kernel() is not None else "int8 kernel not built")
