"""The C++ linear-layer kernels (cpu_linear.cpp): build, load, pack, and pick a path per call.

- ``PackedBf16`` (``pack_bf16``): where the CPU has AMX, bf16 weights packed once at load into
  AMX tiles (cpu_linear_bf16_amx.h), one kernel for every row count, so that a row's output
  does not depend on the batch around it (greedy answers alone = batched = speculated).
- ``bf16_linear``: without AMX (or a layer that does not pack), bf16 weights as stored, through
  ours for every row count where the CPU has AVX512-BF16: a row's output is then the same bits
  whatever the batch (the dot-product kernel sums each row alone, in one order), as on AMX. At
  decode sizes it reads the weights at up to 3x the rate of torch's GEMM; from ~128 rows it is
  1.0-1.2x torch's time (RESULTS.md "bf16 without AMX for every row count"), the price of
  greedy answers that do not depend on the batch.
- ``PackedWeight``: int8 or int4 weights packed once at load; the streamed path (weights read
  once and used by every row in registers) or the AMX-tiled one is chosen by the number of
  rows, from the crossovers measured by ``benchmarks/linear_kernels.py`` (``TILED_FROM_ROWS``).

All need AVX512-BF16 (int8 also AVX512-VNNI; the tiled path AMX, asked of the OS once). CPUs
with AVX2 and FMA but not those (AMD Zen 2 / 3, Intel client cores) get cpu_linear_avx2.cpp
instead: the same entry points and packed layouts, no tiled path, every row count through the
same kernels (batch-invariant too), 1.5-6x torch's speed there (RESULTS.md "Linear layers on
AVX2"). Without either, or without a compiler (or with ``POISE_DISABLE_CPU_KERNEL``), the
layers keep torch's kernels (quant.py, llama.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from poise.model.cpu_build import AVX2_FLAGS, cpu_flags, load_library

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
SOURCE = _DIR / "cpu_linear.cpp"
_SHARED = [_DIR / "cpu_linear_problem.h", _DIR / "cpu_linear_bf16_split.h", _DIR / "cpu_pool.h"]
HEADERS = [
    *(_DIR / f"cpu_linear_{part}.h" for part in ("common", "bf16", "bf16_amx", "int8", "int4")),
    *_SHARED,
]
# CPUs with AVX2 and FMA but not AVX512-BF16 / VNNI: the same entry points and layouts.
SOURCE_AVX2 = _DIR / "cpu_linear_avx2.cpp"
HEADERS_AVX2 = [_DIR / "cpu_linear_avx2.h", _DIR / "cpu_linear_avx2_quant.h", *_SHARED]
_FALLBACK = "linear layers use torch's kernels"
TILE = 16  # output channels per vector
GROUP = 32  # int4 inputs per scale group (and the bf16 AMX K block)
FORMATS = {"int8": 1, "int4": 2}
INT8_MAX_IN = 16384  # the int32 sums' bound (cpu_linear_int8.h)
INT8_BLOCK = 64  # int8 inputs per AMX K block
# Rows from which the AMX-tiled path beats the streamed one (benchmarks/linear_kernels.py,
# SmolLM2-1.7B's layers, RESULTS.md "Linear kernels").
TILED_FROM_ROWS = {"int8": 4, "int4": 4}
# bf16 as stored, where the CPU has AMX: our dot-product kernel up to this many rows, torch's AMX
# GEMM from the next, for the layers that do not pack (a width not a multiple of 16; every other
# layer runs PackedBf16). Without AMX (Zen 4) ours runs every row count: batch-invariant, and
# 1.0-1.2x torch's time at prefill sizes (SmolLM2-135M / 1.7B layers, 2,048 rows: 1.09x / 1.18x).
BF16_ROWS = 2


def bf16_rows() -> int | None:
    """The most rows our bf16 kernel takes; None: every row count."""
    return BF16_ROWS if amx_available() else None


@functools.cache
def load_linear_kernel() -> Any:
    """The loaded library, building it on first use; None where it cannot run."""
    import torch  # noqa: F401  (first: the library must bind to torch's libgomp)

    flags = cpu_flags()
    if {"avx512_bf16", "avx512_vnni"} <= flags:
        lib = load_library("cpu_linear", [SOURCE], HEADERS, _FALLBACK)
    elif AVX2_FLAGS.issubset(flags):
        lib = load_library("cpu_linear_avx2", [SOURCE_AVX2], HEADERS_AVX2, _FALLBACK)
    else:
        logger.info("neither AVX512-BF16 / VNNI nor AVX2 / FMA: %s", _FALLBACK)
        return None
    if lib is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.poise_linear.argtypes = [
        ptr,
        i64,
        i64,  # x [m, k] bf16, m, k
        ptr,
        c_int,
        c_int,  # packed weight, format, tiles per group
        ptr,
        ptr,  # int8: scale [n] float32; int4: d and m [n / 16, k / 32, 2, 16] bf16
        ptr,  # int8: sum of q per channel [n] int32
        i64,
        ptr,
        c_int,
        c_int,  # n, y [m, n] bf16, tiled, threads
    ]
    lib.poise_linear_bf16_rows.argtypes = [ptr, i64, i64, ptr, i64, ptr, c_int]
    lib.poise_linear_bf16_amx.argtypes = [ptr, i64, i64, ptr, c_int, i64, ptr, c_int]
    lib.poise_linear_threading.argtypes = [c_int, c_int]
    lib.poise_linear_threading.restype = None
    fns = (lib.poise_linear, lib.poise_linear_bf16_rows, lib.poise_linear_bf16_amx)
    for fn in (*fns, lib.poise_linear_init):
        fn.restype = c_int
    return lib


# The pool's helpers spin this long after a loop before they sleep (cpu_pool.h).
POOL_SPIN_US = int(os.environ.get("POISE_POOL_SPIN_US", "200"))


def set_threading(openmp: bool = False, spin_us: int = POOL_SPIN_US) -> None:
    """How the decode-sized kernels (these linears, the decode attention) spread their items
    (cpu_pool.h): the pool (default; helpers spin ``spin_us`` after a loop, 0: asleep at once,
    -1: every loop on the caller alone) or, for before / after measurements in one process, an
    OpenMP region per call as before."""
    from poise.model.attention.cpu_kernel import load_cpu_kernel

    lib = load_linear_kernel()
    if lib is not None:
        lib.poise_linear_threading(int(openmp), spin_us)
    attention = load_cpu_kernel()
    if attention is not None:
        attention.poise_attention_threading(int(openmp), spin_us)


@functools.cache
def amx_available() -> bool:
    """AMX tiles usable by this process (the CPU has them and the OS granted the state)."""
    lib = load_linear_kernel()
    return lib is not None and "amx_bf16" in cpu_flags() and bool(lib.poise_linear_init())


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) in bf16 on CPU: our kernel for up to bf16_rows() rows
    (and K % 32 == 0), torch's GEMM otherwise."""
    lib = load_linear_kernel()
    m, k = x.shape
    limit = bf16_rows()
    if (limit is not None and m > limit) or lib is None or k % GROUP or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    x = x.contiguous()
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    lib.poise_linear_bf16_rows(
        x.data_ptr(), m, k, weight.data_ptr(), n, y.data_ptr(), torch.get_num_threads()
    )
    return y if bias is None else y + bias


@dataclass
class PackedBf16:
    """bf16 weights [N, K] packed for the AMX kernel (cpu_linear_bf16_amx.h), which runs every
    row count: a row's output is the same bits whatever the batch, chunk or verify rows
    around it (the reason to pack; see the header)."""

    packed: torch.Tensor  # [N / 16t, K / 32, t, 16, 16, 2] bf16: groups, K blocks, B tiles
    tiles: int
    out_features: int
    in_features: int

    def unpack(self) -> torch.Tensor:
        """The weights as [N, K] again (pack_bf16's inverse)."""
        w = self.packed.permute(0, 2, 4, 1, 3, 5)  # [groups, t, 16 channels, K blocks, 16, 2]
        return w.reshape(self.out_features, self.in_features).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 -> y [M, N] bf16."""
        lib = load_linear_kernel()
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.bfloat16)
        rc = lib.poise_linear_bf16_amx(
            x.data_ptr(),
            m,
            self.in_features,
            self.packed.data_ptr(),
            self.tiles,
            self.out_features,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(
                f"linear kernel: bf16 [{m}, {self.in_features}] x [{self.out_features}, "
                f"{self.in_features}] does not fit its packing"
            )
        return y


def bf16_packs(weight: torch.Tensor) -> bool:
    """Whether this bf16 CPU weight [N, K] runs on the AMX kernel for every row count."""
    n, k = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and n % TILE == 0
        and k % GROUP == 0
        and amx_available()
    )


def pack_bf16(weight: torch.Tensor) -> PackedBf16:
    """[N, K] bf16 -> the AMX kernel's layout: channel groups of 2 tiles (1 where N is not a
    multiple of 32), each group's K blocks in order, each block's B tiles in VNNI order
    [16 input pairs][16 channels][2]."""
    if not amx_available():  # also asks the OS for the tile state, before any tile is used
        raise RuntimeError("pack_bf16: this CPU or process cannot use AMX tiles")
    n, k = weight.shape
    t = 2 if n % (2 * TILE) == 0 else 1
    w = weight.reshape(n // (TILE * t), t, TILE, k // GROUP, GROUP // 2, 2)
    packed = w.permute(0, 3, 1, 4, 2, 5).contiguous()
    return PackedBf16(packed, t, n, k)


def tiles_per_group(out_features: int) -> int | None:
    """The widest group of 16-channel tiles that divides the layer; None when 16 does not."""
    for t in (4, 2, 1):
        if out_features % (TILE * t) == 0:
            return t
    return None


def fits(fmt: str, out_features: int, in_features: int) -> bool:
    """The kernel can run this layer on both paths (the tiled one's K blocks are the widest)."""
    if load_linear_kernel() is None or tiles_per_group(out_features) is None:
        return False
    if fmt == "int8":  # any width: padded to the K block (pack_int8)
        return in_features <= INT8_MAX_IN
    return in_features % GROUP == 0


def _groups(w: torch.Tensor, t: int, inner: int) -> torch.Tensor:
    """[N, K] -> [N / 16t, K / inner, t, 16, inner]: the kernel's channel groups, each as runs
    of ``inner`` consecutive inputs (quads for int8, pairs for int4)."""
    n, k = w.shape
    w = w.reshape(n // (TILE * t), t, TILE, k // inner, inner)
    return w.permute(0, 3, 1, 2, 4).contiguous()


def _int4_words(q: torch.Tensor, t: int) -> torch.Tensor:
    """uint8 q in [0, 15] [N, K] -> int32 words [N / 16t, K / 8, t, 16]: for input pairs
    4j..4j+3, pair s's first input at bit 4s of the word, its second at bit 16 + 4s."""
    g = _groups(q.to(torch.int32), t, inner=2)  # [G, K/2, t, 16, 2]
    groups, kp = g.shape[:2]
    g = g.reshape(groups, kp // 4, 4, t, TILE, 2)  # dim 2: the pair s within its word
    shifts = (4 * torch.arange(4, dtype=torch.int32)).view(1, 1, 4, 1, 1)
    words = (g[..., 0] << shifts) | (g[..., 1] << (shifts + 16))
    return words.sum(dim=2, dtype=torch.int32).contiguous()


def _group_scales(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """int4 d and m [N, K / 32] -> bf16 [N / 16, K / 32, 2, 16]: per tile and group, 16 d
    then 16 m."""
    n, g = d.shape
    dm = torch.stack((d, m), dim=-1).bfloat16()  # [N, G, 2]
    return dm.reshape(n // TILE, TILE, g, 2).permute(0, 2, 3, 1).contiguous()


@dataclass
class PackedWeight:
    """One quantized weight matrix in the kernel's layout, with what its format needs."""

    fmt: str
    packed: torch.Tensor
    tiles: int
    out_features: int
    in_features: int  # the kernel's: int8 pads the layer's to INT8_BLOCK
    scale: torch.Tensor | None = None  # int8: [N] float32
    dm: torch.Tensor | None = None  # int4: d and m, bf16 [N/16, G, 2, 16]
    rowsum: torch.Tensor | None = None  # int8: sum of q per output channel, int32

    def tiled(self, rows: int) -> bool:
        return rows >= TILED_FROM_ROWS[self.fmt] and amx_available()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 -> y [M, N] bf16."""
        lib = load_linear_kernel()
        m, width = x.shape
        x = x.contiguous() if width == self.in_features else F.pad(x, (0, self.in_features - width))
        y = torch.empty(m, self.out_features, dtype=torch.bfloat16)
        extras = (self.scale, self.dm, self.rowsum)
        rc = lib.poise_linear(
            x.data_ptr(),
            m,
            self.in_features,
            self.packed.data_ptr(),
            FORMATS[self.fmt],
            self.tiles,
            *(t.data_ptr() if t is not None else None for t in extras),
            self.out_features,
            y.data_ptr(),
            int(self.tiled(m)),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(
                f"linear kernel: [{m}, {self.in_features}] x [{self.out_features}, "
                f"{self.in_features}] in {self.fmt} does not fit its packing"
            )
        return y


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> PackedWeight:
    """q int8 [N, K], scale [N]: w = q * scale; K padded with zero weights to INT8_BLOCK."""
    n, width = q.shape
    t = tiles_per_group(n)
    assert t is not None
    k = -(-width // INT8_BLOCK) * INT8_BLOCK
    q = F.pad(q, (0, k - width))
    rowsum = q.to(torch.int32).sum(dim=1, dtype=torch.int32)
    return PackedWeight(
        "int8", _groups(q, t, inner=4), t, n, k, scale=scale.float().contiguous(), rowsum=rowsum
    )


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> PackedWeight:
    """q [N, K] in [0, 15], d and m [N, K / 32]: w = q * d + m."""
    n, k = q.shape
    t = tiles_per_group(n)
    assert t is not None
    return PackedWeight("int4", _int4_words(q, t), t, n, k, dm=_group_scales(d, m))


if __name__ == "__main__":  # `python -m poise.model.linear_kernel`: build ahead of time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ready = load_linear_kernel() is not None
    print(f"linear kernel {'ready' if ready else 'not built'}, AMX {amx_available()}")
