"""Fixtures for lab tests: command templates that start the scripted engine as a subprocess,
a tiny lab workload, and a check that a PID is really gone."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from poise.bench.bench_config import WorkloadSpec

HERE = Path(__file__).resolve().parent
MOCK_TEMPLATE = (
    f"{sys.executable} {HERE / 'mock_engine_server.py'} --port {{port}} "
    "--max-num-batched-tokens {max_num_batched_tokens} --max-num-seqs {max_num_seqs}"
)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still in the table: only acceptable as a zombie nobody reaped (not ours: we wait()).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


@pytest.fixture
def tiny_workload() -> WorkloadSpec:
    return WorkloadSpec(
        concurrency=(4,),
        long_ratio=(0.0,),
        max_tokens=32,
        num_requests=8,
        warmup=2,
        long_repeat=5,
        timeout_s=30,
    )
