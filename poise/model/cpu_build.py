"""Build a C++ CPU kernel library once, just in time, and cache it (attention/cpu_kernel.py,
linear_kernel.py, elementwise.py).

Why just in time: the kernels are compiled with ``-march=native`` for the machine they run on
(AVX-512 where there is AVX-512), which a prebuilt wheel cannot do, and they need only a C++
compiler, not torch's headers, so a build takes seconds. Libraries are cached under
``$POISE_KERNEL_CACHE`` (default ``~/.cache/poise/kernels``), keyed by a hash of the sources,
the flags, the compiler and the CPU, so an edit, another compiler or another machine sharing
the home directory gets its own build. Built to a temporary name and renamed into place, so
concurrent processes never load a half-written file. ``POISE_DISABLE_CPU_KERNEL=1`` disables
every kernel (the torch paths run instead).

The libraries link ``libgomp.so.1``; torch has already loaded its own copy under that name, so
the kernels share torch's OpenMP runtime and thread count instead of starting a second pool.
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
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


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


# The flags of the AVX2 kernel builds (cpu_linear_avx2.cpp; the attention and elementwise
# kernels' AVX2 bodies): where the CPU has them but not AVX-512, those run.
AVX2_FLAGS = frozenset({"avx2", "fma"})


@functools.lru_cache(maxsize=1)
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo does not exist):
    which kernel build, or none, runs here; runner/platform.py's dtype choice reads them too."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _cpu_signature() -> str:
    """The CPU's model and flags: a -march=native build is only valid on the same kind."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))


def _build(compiler: str, sources: Sequence[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, "-o", tmp, *map(str, sources)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_library(
    stem: str, sources: Sequence[Path], headers: Sequence[Path], fallback: str
) -> Path | None:
    """Path of the library ``<stem>-<key>.so``, built when not cached; None (logged once per
    call, saying what runs instead: ``fallback``) when it cannot be built."""
    if os.environ.get("POISE_DISABLE_CPU_KERNEL"):
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler found: %s", fallback)
        return None
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        "\0".join(
            [*(f.read_text() for f in (*sources, *headers)), *FLAGS, version, _cpu_signature()]
        ).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{key}.so"
    if not target.exists():
        logger.info("building %s into %s", stem, target)
        try:
            _build(compiler, sources, target)
        except (OSError, RuntimeError) as exc:
            logger.warning("%s unavailable (%s): %s", stem, exc, fallback)
            return None
    return target


def load_library(
    stem: str, sources: Sequence[Path], headers: Sequence[Path], fallback: str
) -> ctypes.CDLL | None:
    """``build_library``, then the loaded library; None (logged, saying ``fallback``) when it
    cannot be built or loaded. Call after importing torch: the library must bind to torch's
    libgomp."""
    target = build_library(stem, sources, headers, fallback)
    if target is None:
        return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        logger.warning("%s unavailable (%s): %s", stem, exc, fallback)
        return None
