"""Build (once, cached) and load the C++ paged-attention kernels for CPU (decode rows and prefill).

Why a just-in-time build: the kernel is compiled with ``-march=native`` for the machine it runs
on (AVX-512 where there is AVX-512), which a prebuilt wheel cannot do, and it needs only a C++
compiler, not torch's headers, so the first build takes seconds. The shared library is cached
under ``$POISE_KERNEL_CACHE`` (default ``~/.cache/poise/kernels``), keyed by a hash of the
source, the flags, the compiler and the CPU, so an edit, another compiler or another machine
sharing the home directory gets its own build. Built to a temporary name and renamed into place,
so concurrent processes never load a half-written file.

Without a compiler (or if the build fails) ``load_cpu_kernel()`` returns None, logs why once, and
the ``auto`` attention backend falls back to the plain torch one.

The library links ``libgomp.so.1``; torch has already loaded its own copy under that name, so
the kernel shares torch's OpenMP runtime and thread count instead of starting a second pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# Compiled together into one library; the header is part of the cache key.
SOURCES = (_HERE / "cpu_paged_attention.cpp", _HERE / "cpu_prefill_attention.cpp")
HEADERS = (_HERE / "cpu_attention_common.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

# Both entry points: (dtype, q, kv_cache, what to attend, shapes, out, [partition], threads).
_HEAD: list[Any] = [
    ctypes.c_int,  # dtype: 0 float32, 1 bfloat16
    ctypes.c_void_p,  # q
    ctypes.c_int64,  # q token stride
    ctypes.c_void_p,  # kv_cache
    ctypes.c_void_p,  # tables [rows of tables, table stride]
    ctypes.c_int64,  # table stride
]
_SHAPES: list[Any] = [
    ctypes.c_int,  # num_heads
    ctypes.c_int,  # num_kv_heads
    ctypes.c_int,  # head_dim
    ctypes.c_int,  # block_size
    ctypes.c_float,  # scale
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # out token stride
]
_THREE_ARRAYS_AND_COUNT: list[Any] = [ctypes.c_void_p] * 3 + [ctypes.c_int]
# poise_paged_attention (decode rows, cpu_paged_attention.cpp): row_table, row_token,
# context_len, num_rows; then the partition size.
_ARGTYPES = [*_HEAD, *_THREE_ARRAYS_AND_COUNT, *_SHAPES, ctypes.c_int, ctypes.c_int]
# poise_paged_prefill (prefill chunks, cpu_prefill_attention.cpp): query_start, query_len,
# start_position, num_chunks.
_PREFILL_ARGTYPES = [*_HEAD, *_THREE_ARRAYS_AND_COUNT, *_SHAPES, ctypes.c_int]


def cache_dir() -> Path:
    configured = os.environ.get("POISE_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "poise" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """The CPU's model and flags: a -march=native build is only valid on the same kind."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, "-o", tmp, *map(str, SOURCES)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_cpu_kernel() -> Path | None:
    """Path of the built library, building it when not cached; None when it cannot be built."""
    if os.environ.get("POISE_DISABLE_CPU_KERNEL"):
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler found: CPU attention uses the slower torch backend")
        return None
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        "\0".join(
            [*(f.read_text() for f in (*SOURCES, *HEADERS)), *FLAGS, version, _cpu_signature()]
        ).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"cpu_paged_attention-{key}.so"
    if not target.exists():
        logger.info("building the CPU attention kernel into %s", target)
        try:
            _build(compiler, target)
        except (OSError, RuntimeError) as exc:
            logger.warning("CPU attention kernel unavailable, using the torch backend: %s", exc)
            return None
    return target


@functools.cache
def load_cpu_kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None when it cannot be built."""
    import torch  # noqa: F401  (first: the library must bind to torch's libgomp)

    target = build_cpu_kernel()
    if target is None:
        return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        logger.warning("CPU attention kernel unavailable, using the torch backend: %s", exc)
        return None
    fn = lib.poise_paged_attention
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    prefill = lib.poise_paged_prefill
    prefill.argtypes = _PREFILL_ARGTYPES
    prefill.restype = ctypes.c_int
    return lib


if __name__ == "__main__":  # `python -m poise.model.attention.cpu_kernel`: build ahead of time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build_cpu_kernel()
    print(built if built is not None else "CPU attention kernel not built (see above)")
