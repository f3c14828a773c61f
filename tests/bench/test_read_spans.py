"""benchmarks/hardware.py's streaming reads: several buffers in one call read every byte of each
(the peer of a layer's kernel call in floor.py), checked by the lanes' sum."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from hardware import read_spans  # noqa: E402


@pytest.mark.parametrize("threads", [1, 2])
def test_read_spans_reads_every_line_of_every_buffer(threads: int) -> None:
    # 64-bit words of known values: each buffer's sum is words x value, and the call's
    # sum (mod 2^64) is theirs added, whatever the split of lines over threads.
    sizes = [64 * 7, 64 * 1000, 64 * 33]
    bufs = [torch.full((n // 8,), i + 1, dtype=torch.int64) for i, n in enumerate(sizes)]
    read = read_spans([(b.data_ptr(), b.numel() * 8) for b in bufs], threads)
    assert read() == sum((i + 1) * n // 8 for i, n in enumerate(sizes))
    # Without the last buffer, exactly its sum is missing.
    short = read_spans([(b.data_ptr(), b.numel() * 8) for b in bufs[:-1]], threads)
    assert short() == read() - 3 * sizes[-1] // 8
