"""A process tree's CPU time split into its engine threads and the rest (/proc)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from poise.lab import cpu_accounting as acc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A parent (not an engine) and its child (the "engine" process): the child's main thread
# spins ~0.6 s of CPU and a second thread ~0.15 s; the parent ~0.15 s.
_SPIN = "def spin(s):\n    import time\n    t = time.thread_time()\n    while time.thread_time() - t < s: pass\n"
_CHILD = _SPIN + textwrap.dedent("""
    import sys, threading
    sys.stdin.readline()
    t = threading.Thread(target=spin, args=(0.15,)); t.start(); spin(0.6); t.join()
    print("done", flush=True); sys.stdin.readline()
""")
_PARENT = _SPIN + textwrap.dedent(f"""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", {_CHILD!r}], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    print(child.pid, flush=True)
    sys.stdin.readline(); spin(0.15)
    child.stdin.write("go\\n"); child.stdin.flush(); child.stdout.readline()
    print("done", flush=True); sys.stdin.readline()
    child.stdin.write("end\\n"); child.stdin.flush(); child.wait()
""")


def test_split_counts_the_busiest_thread_of_each_engine_process_as_the_engine() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        child = int(proc.stdout.readline())
        assert acc.descendants(proc.pid) == [proc.pid, child]
        engine = lambda pid, cmd: pid == child  # noqa: E731
        before = acc.read(proc.pid, engine)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        after = acc.read(proc.pid, engine)
        got = acc.split(before, after, include_client=False)
        assert {pid for pid, _ in after.engine_threads} == {child}
        assert 0.5 <= got.engine_s <= 0.9
        assert 0.25 <= got.other_s <= 0.6  # the child's second thread and the parent
        proc.stdin.write("end\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ray_engine_replicas_are_told_from_the_router_and_the_proxy() -> None:
    assert acc.ray_engine_replica(1, "ray::ServeReplica:poise:engine-1")
    assert not acc.ray_engine_replica(1, "ray::ServeReplica:poise:router")
    assert not acc.ray_engine_replica(1, "ray::ProxyActor")
