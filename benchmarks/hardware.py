"""The machine's floors, measured: DRAM read bandwidth and the bf16 / int8 matmul peaks.

- ``read_bandwidth``: bytes per second of a streaming read (read_bandwidth.cpp: AVX-512
  loads, every thread on its own slice) over a buffer far larger than any cache; a decode
  step reads each weight byte once, so weight bytes / this is its floor. Best of ``repeats``.
- ``bf16_peak``: FLOP/s of one large square bf16 GEMM through ``F.linear`` (oneDNN, AMX tiles
  where the CPU has them), the floor of a compute-bound prefill in bf16.
- ``int8_peaks``: OP/s of the same GEMM in int8 through ``torch._int_mm`` and through oneDNN's
  quantized linear (``onednn::qlinear_pointwise``, uint8 activations x int8 weights, AMX /
  VNNI), the floor of a prefill with int8 activations; the faster one is the peak.

Importable from any benchmark (``from hardware import read_bandwidth`` with benchmarks/ on
``sys.path``, as running a script from there puts it); each function takes its sizes so a
test can run it on tiny buffers.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from poise.model.cpu_build import build_library

SOURCE = Path(__file__).parent / "read_bandwidth.cpp"
GIB = 1 << 30


@functools.cache
def _library() -> ctypes.CDLL:
    """read_bandwidth.cpp, built on first use (cached like the model's kernels), both entry
    points typed."""
    target = build_library("read_bandwidth", [SOURCE], [], "no read-bandwidth kernel")
    if target is None:
        raise RuntimeError("the read-bandwidth kernel could not be built (see the log)")
    lib = ctypes.CDLL(str(target))
    lib.poise_read_bytes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.poise_read_spans.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.poise_read_bytes.restype = lib.poise_read_spans.restype = ctypes.c_uint64
    return lib


def _read_kernel() -> Any:
    """``poise_read_bytes``: one buffer."""
    return _library().poise_read_bytes


def _read_spans_kernel() -> Any:
    """``poise_read_spans``: several buffers read in one parallel region."""
    return _library().poise_read_spans


def read_spans(spans: list[tuple[int, int]], threads: int) -> Callable[[], int]:
    """A call that streams every (pointer, bytes) span once, all of them in one parallel
    region of ``threads`` threads (the arrays are built once, here)."""
    ptrs = (ctypes.c_void_p * len(spans))(*(p for p, _ in spans))
    sizes = (ctypes.c_int64 * len(spans))(*(n for _, n in spans))
    fn, count = _read_spans_kernel(), len(spans)
    return lambda: int(fn(ptrs, sizes, count, threads))


def _best_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _buffer(nbytes: int) -> torch.Tensor:
    # Written once (1.0 everywhere), so every page is backed by memory, not the zero page.
    return torch.full((nbytes // 4,), 1.0, dtype=torch.float32)


def read_bandwidth(nbytes: int = 2 * GIB, repeats: int = 5, threads: int | None = None) -> float:
    """Bytes per second of the streaming-read kernel over ``nbytes``, best of ``repeats``."""
    fn = _read_kernel()
    buf = _buffer(nbytes)
    n = buf.numel() * 4
    count = threads or torch.get_num_threads()
    expected = (n // 64) * 64 // 8 * 0x3F8000003F800000  # the lanes' sum (mod 2^64)
    if fn(buf.data_ptr(), n, count) != expected % (1 << 64):
        raise RuntimeError("read-bandwidth kernel: wrong checksum")
    return n / _best_seconds(lambda: fn(buf.data_ptr(), n, count), repeats, warmup=0)


def torch_sum_bandwidth(nbytes: int = 2 * GIB, repeats: int = 5) -> float:
    """Bytes per second of ``torch.sum`` over a float32 buffer (the issue's first figure)."""
    buf = _buffer(nbytes)
    return buf.numel() * 4 / _best_seconds(lambda: buf.sum(), repeats)


def bf16_peak(size: int = 4096, repeats: int = 5) -> float:
    """FLOP/s of a [size, size] x [size, size] bf16 GEMM through F.linear."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen).to(torch.bfloat16)
    w = torch.randn(size, size, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        seconds = _best_seconds(lambda: F.linear(x, w), repeats)
    return 2 * size**3 / seconds


def int8_peaks(size: int = 4096, repeats: int = 5) -> dict[str, float]:
    """OP/s of a [size, size] x [size, size] int8 GEMM, per path that runs here."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (size, size), dtype=torch.int8, generator=gen)
    ops = 2 * size**3
    out: dict[str, float] = {}
    with torch.inference_mode():
        a = torch.randint(-127, 128, (size, size), dtype=torch.int8, generator=gen)
        b = w.t().contiguous()  # [K, N] row-major: _int_mm's faster layout here
        out["torch._int_mm"] = ops / _best_seconds(lambda: torch._int_mm(a, b), repeats)
        onednn = getattr(torch.ops, "onednn", None)
        if onednn is not None and hasattr(onednn, "qlinear_pointwise"):
            x = torch.randint(0, 256, (size, size), dtype=torch.uint8, generator=gen)
            packed = onednn.qlinear_prepack(w.t(), [size, size])
            scales = torch.full((size,), 0.01)
            zeros = torch.zeros(size, dtype=torch.int64)

            def qlinear() -> torch.Tensor:
                return onednn.qlinear_pointwise(  # type: ignore[no-any-return]
                    x,
                    0.01,
                    0,
                    packed,
                    scales,
                    zeros,
                    None,
                    1.0,
                    0,
                    torch.bfloat16,
                    "none",
                    [],
                    "",
                )

            out["onednn qlinear u8s8"] = ops / _best_seconds(qlinear, repeats)
    return out


@dataclass
class Floors:
    """The floors of a run. Each is measured at the start, between models and at the end
    (``remeasure``), and the best measurement is the floor: what the machine can do, not what
    it did while a neighbour had the memory bus or a core."""

    bandwidth_bytes: int  # sizes measured with
    gemm_size: int
    read_samples: list[float] = field(default_factory=list)  # bytes/s, the kernel's
    torch_sum_samples: list[float] = field(default_factory=list)
    bf16_samples: list[float] = field(default_factory=list)  # FLOP/s
    int8_samples: dict[str, list[float]] = field(default_factory=dict)  # OP/s per path

    @property
    def read_bytes_per_s(self) -> float:
        return max(self.read_samples)

    @property
    def bf16_flops(self) -> float:
        return max(self.bf16_samples)

    @property
    def int8_ops(self) -> float:
        """The fastest int8 path's best."""
        return max(max(v) for v in self.int8_samples.values())

    def remeasure(self, repeats: int) -> None:
        for path, ops in int8_peaks(self.gemm_size, repeats).items():
            self.int8_samples.setdefault(path, []).append(ops)
        self.read_samples.append(read_bandwidth(self.bandwidth_bytes, repeats))
        self.torch_sum_samples.append(torch_sum_bandwidth(self.bandwidth_bytes, repeats))
        self.bf16_samples.append(bf16_peak(self.gemm_size, repeats))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            read_bytes_per_s=self.read_bytes_per_s,
            bf16_flops=self.bf16_flops,
            int8_ops=self.int8_ops,
        )
        return out

    def describe(self) -> str:
        def each(values: list[float]) -> str:
            return "/".join(f"{v / 1e9:.1f}" if v < 1e11 else f"{v / 1e9:.0f}" for v in values)

        paths = ", ".join(f"{k} {each(v)}" for k, v in self.int8_samples.items())
        return (
            f"DRAM read {self.read_bytes_per_s / 1e9:.1f} GB/s (best of {each(self.read_samples)}"
            f" over {self.bandwidth_bytes / GIB:.2f} GiB; torch.sum {each(self.torch_sum_samples)});"
            f" bf16 GEMM {self.bf16_flops / 1e9:.0f} GFLOP/s (best of {each(self.bf16_samples)});"
            f" int8 GEMM {self.int8_ops / 1e9:.0f} GOP/s ({paths}) at {self.gemm_size}^3"
        )


def measure_floors(bandwidth_bytes: int, gemm_size: int, repeats: int) -> Floors:
    floors = Floors(bandwidth_bytes, gemm_size)
    floors.remeasure(repeats)
    return floors
