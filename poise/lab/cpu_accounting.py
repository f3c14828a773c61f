"""CPU time of a server's process tree, split into its engine threads and everything else.

Linux only (``/proc``). On a machine where engine replicas share the cores with what relays
their requests and tokens (HTTP proxy, router, the replicas' own event loops, the client), a
replica's step is as fast as the share of a core its engine thread gets; the simulator's
``SharedCpu`` (``poise.sim.cpu_share``) models that from what the relay costs per request and
per token, which this reads from an idle server and from a concurrency-1 cell.

An engine thread is the busiest thread of an engine process over the window (the thread that
runs the steps); ``is_engine`` names the engine processes: the plain server's own process, or
Ray Serve's replica actors of ``poise serve --replicas``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_TICK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, of every process now."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d.name))
    return children


def descendants(root: int) -> list[int]:
    """``root`` and every process under it (root first)."""
    children = children_map()
    todo, out = [root], []
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def thread_ids(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    return []


def cpu_s(stat: str) -> float:
    """User + system CPU seconds from a ``/proc/.../stat`` path (0 once it is gone). A
    process's counts every thread it ran, those that have ended too."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    return 0.0


def command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    return ""


def ray_engine_replica(pid: int, cmd: str) -> bool:
    """Ray Serve's actor of one of poise's engine deployments (``engine-0`` ...)."""
    return "ServeReplica:" in cmd and ":engine-" in cmd


@dataclass(frozen=True)
class TreeCpu:
    """One reading: every process's CPU seconds, the threads of the engine processes, and the
    reading process's own CPU (the client) before the reading began and after it ended, so
    that the reading's own cost stays out of a difference of two."""

    processes: dict[int, float]
    engine_threads: dict[tuple[int, int], float]
    client_before_s: float
    client_after_s: float
    at: float  # time.monotonic()


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds between two readings: the engines' threads, and everything else."""

    engine_s: float
    other_s: float
    wall_s: float


def read(root: int, is_engine: Callable[[int, str], bool]) -> TreeCpu:
    before = time.process_time()
    at = time.monotonic()
    processes: dict[int, float] = {}
    threads: dict[tuple[int, int], float] = {}
    for pid in descendants(root):
        processes[pid] = cpu_s(f"/proc/{pid}/stat")
        if is_engine(pid, command(pid)):
            for tid in thread_ids(pid):
                threads[(pid, tid)] = cpu_s(f"/proc/{pid}/task/{tid}/stat")
    return TreeCpu(processes, threads, before, time.process_time(), at)


def split(a: TreeCpu, b: TreeCpu, include_client: bool = True) -> CpuSplit:
    """What ran between readings ``a`` and ``b``: per engine process its busiest thread is the
    engine; the rest of the tree (and this process, the client, unless told not to) is not."""
    busiest: dict[int, float] = {}
    for (pid, tid), v in b.engine_threads.items():
        busiest[pid] = max(busiest.get(pid, 0.0), v - a.engine_threads.get((pid, tid), 0.0))
    engine = sum(busiest.values())
    other = sum(v - a.processes.get(pid, 0.0) for pid, v in b.processes.items()) - engine
    if include_client:
        other += max(0.0, b.client_before_s - a.client_after_s)
    return CpuSplit(engine, max(0.0, other), b.at - a.at)
