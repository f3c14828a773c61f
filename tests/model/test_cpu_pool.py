"""The linear kernels' thread pool (model/cpu_pool.h): the decode-sized paths (bf16 rows,
int8 / int4 streamed, int8 blocked) give the same bits whichever way their items run (the pool
with helpers spinning or asleep, the caller alone, an OpenMP region as before), from several
Python threads at once, and in a forked child (which has no helpers)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from poise.model import linear_kernel as lk
from poise.model.quant import quantize_int4, quantize_int8
from tests.model.test_linear_bf16 import _ours as bf16_rows

pytestmark = pytest.mark.skipif(
    lk.load_linear_kernel() is None, reason="no AVX512-BF16 / VNNI or no C++ compiler"
)

MODES = [(False, 200), (False, 0), (False, -1), (True, 200)]  # (openmp, spin_us)


@pytest.fixture(autouse=True)
def _default_threading() -> Iterator[None]:
    yield
    lk.set_threading()


def _cases() -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, call) for each path: every call runs on 2 threads (lk passes torch's count)."""
    torch.manual_seed(0)
    w = torch.randn(256, 576)
    wb = w.bfloat16()
    packed8 = lk.pack_int8(*quantize_int8(w))
    q4, d, m = quantize_int4(w)
    packed4 = lk.pack_int4(q4, d, m)
    x = {rows: torch.randn(rows, 576).bfloat16() for rows in (1, 2, 7, 70)}
    return [
        ("bf16 1 row", lambda: bf16_rows(x[1], wb)),
        ("bf16 7 rows", lambda: bf16_rows(x[7], wb)),
        ("bf16 70 rows (chunked)", lambda: bf16_rows(x[70], wb)),
        ("int8 2 rows (streamed)", lambda: packed8(x[2])),
        ("int8 7 rows (blocked)", lambda: packed8(x[7])),
        ("int4 1 row", lambda: packed4(x[1])),
        ("int4 7 rows", lambda: packed4(x[7])),
    ]


def test_every_threading_mode_gives_the_same_bits() -> None:
    torch.set_num_threads(2)
    cases = _cases()
    lk.set_threading(openmp=False, spin_us=-1)
    want = {name: call() for name, call in cases}
    for openmp, spin in MODES:
        lk.set_threading(openmp=openmp, spin_us=spin)
        for _ in range(3):  # helpers awake from the call before, or just woken
            for name, call in cases:
                assert torch.equal(call(), want[name]), (name, openmp, spin)


def test_callers_on_several_threads_at_once() -> None:
    torch.set_num_threads(2)
    cases = _cases()
    want = {name: call() for name, call in cases}
    failures: list[str] = []

    def caller(offset: int) -> None:
        for i in range(40):
            name, call = cases[(i + offset) % len(cases)]
            if not torch.equal(call(), want[name]):
                failures.append(name)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert failures == []


def test_a_forked_child_runs_the_kernels() -> None:
    # The child has no helpers (only the forking thread survives a fork): its loops run on the
    # caller. Only our kernels run in it: libgomp's regions hang in a forked child.
    torch.set_num_threads(2)
    cases = _cases()
    want = [call() for _, call in cases]  # helpers started in this process
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if every path gives the parent's bits
        ok = all(torch.equal(call(), w) for (_, call), w in zip(cases, want, strict=True))
        os._exit(0 if ok else 3)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")
