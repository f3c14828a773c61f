"""Build (once, cached: model/cpu_build.py) and load the C++ paged-attention kernels for CPU
(decode rows and prefill).

Without a compiler (or if the build fails) ``load_cpu_kernel()`` returns None, logs why once, and
the ``auto`` attention backend falls back to the plain torch one.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

from poise.model.cpu_build import build_library

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# Compiled together into one library; the header is part of the cache key.
SOURCES = (
    _HERE / "cpu_paged_attention.cpp",
    _HERE / "cpu_prefill_attention.cpp",
    _HERE / "cpu_paged_attention_int8.cpp",
    _HERE / "cpu_kv_write.cpp",
)
HEADERS = (
    _HERE / "cpu_attention_common.h",
    _HERE / "cpu_attention_avx2.h",
    _HERE / "cpu_kv_int8.h",
    _HERE / "cpu_decode_cascade.h",
    _HERE / "cpu_decode_vectors.h",
    _HERE / "cpu_decode_amx.h",
    _HERE / "cpu_amx.h",
    _HERE / "cpu_prefill_blocks.h",
    _HERE / "cpu_prefill_avx2.h",
    _HERE / "cpu_prefill_amx.h",
    _HERE / "cpu_prefill_pack.h",
    _HERE / "cpu_prefill_share.h",
    _HERE / "cpu_prefill_items.h",
    _HERE.parent / "cpu_pool.h",
)

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
# The int8 KV cache's entry points take the same arguments (head_dim: q's, the cache rows being
# head_dim + 2 bytes): poise_paged_attention_int8, poise_paged_prefill_int8. The K/V writers
# (cpu_kv_write.cpp), poise_write_kv_int8 and poise_write_kv (a cache in kv's dtype): dtype,
# kv, kv token stride, slots, tokens, rows (2 * Hkv), head_dim, kv_cache, threads.
_WRITE_KV_ARGTYPES: list[Any] = [
    ctypes.c_int,  # dtype of kv
    ctypes.c_void_p,  # kv
    ctypes.c_int64,  # kv token stride
    ctypes.c_void_p,  # slots
    *[ctypes.c_int] * 3,  # tokens, rows, head_dim
    ctypes.c_void_p,  # kv_cache
    ctypes.c_int,  # threads
]


def build_cpu_kernel() -> Path | None:
    """Path of the built library, building it when not cached; None when it cannot be built."""
    return build_library(
        "cpu_paged_attention", SOURCES, HEADERS, "CPU attention uses the slower torch backend"
    )


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
    for name, argtypes in (
        ("poise_paged_attention", _ARGTYPES),
        ("poise_paged_prefill", _PREFILL_ARGTYPES),
        ("poise_paged_attention_int8", _ARGTYPES),
        ("poise_paged_prefill_int8", _PREFILL_ARGTYPES),
        ("poise_write_kv_int8", _WRITE_KV_ARGTYPES),
        ("poise_write_kv", _WRITE_KV_ARGTYPES),
    ):
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.poise_prefill_use_amx.argtypes = [ctypes.c_int]
    lib.poise_prefill_use_amx.restype = ctypes.c_int
    lib.poise_decode_use_cascade.argtypes = [ctypes.c_int]
    lib.poise_decode_use_cascade.restype = ctypes.c_int
    lib.poise_decode_use_amx.argtypes = [ctypes.c_int]
    lib.poise_decode_use_amx.restype = ctypes.c_int
    lib.poise_attention_threading.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.poise_attention_threading.restype = None
    # tables, table stride, row_table, context_len, rows, block size, shared keys out
    lib.poise_decode_groups.argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 2]
    lib.poise_decode_groups.argtypes += [ctypes.c_int] * 3 + [ctypes.c_void_p]
    lib.poise_decode_groups.restype = ctypes.c_int
    return lib


def use_prefill_amx(enable: bool | None = None) -> bool:
    """Whether bf16 prefills run Q K^T and P V on AMX tiles (cpu_prefill_amx.h), as they do
    wherever the CPU and the OS allow it. ``enable=False`` keeps them on the AVX512-BF16 vectors
    (tests compare both paths on one machine), True allows AMX again, None only asks."""
    lib = load_cpu_kernel()
    if lib is None:
        return False
    return bool(lib.poise_prefill_use_amx(-1 if enable is None else int(enable)))


def use_decode_amx(enable: bool | None = None) -> bool:
    """Whether bf16 decode rows (head_dim 64 or 128, blocks of a multiple of 16 keys) run on AMX
    tiles (cpu_decode_amx.h), as they do wherever the CPU and the OS allow it. ``enable=False``
    keeps them on the vectors (tests compare both paths on one machine), None only asks."""
    lib = load_cpu_kernel()
    if lib is None:
        return False
    return bool(lib.poise_decode_use_amx(-1 if enable is None else int(enable)))


def use_decode_cascade(enable: bool | None = None) -> bool:
    """Whether the decode kernel attends rows that share prefix blocks together (cascade:
    cpu_decode_cascade.h), as it does unless turned off; the setting is the library's, for the
    whole process (the backend sets its own before each step). None only asks."""
    lib = load_cpu_kernel()
    if lib is None:
        return False
    return bool(lib.poise_decode_use_cascade(-1 if enable is None else int(enable)))


if __name__ == "__main__":  # `python -m poise.model.attention.cpu_kernel`: build ahead of time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build_cpu_kernel()
    print(built if built is not None else "CPU attention kernel not built (see above)")
