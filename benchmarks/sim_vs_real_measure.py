"""The measured side of benchmarks/sim_vs_real.py: profile slices and the rounds of cells
on one traced ``poise serve``, each cell's record linked to its span of the step trace."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from poise.bench.bench_config import BenchConfig, WorkloadSpec
from poise.bench.record import ExperimentRecord
from poise.bench.runner import run_matrix
from poise.cli.options import add_engine_args, engine_config_from_args
from poise.config import EngineConfig
from poise.lab.calibration import link_step_trace
from poise.lab.managed_server import ManagedServer, ServerSpec

REPO = Path(__file__).resolve().parents[1]


CAL_REQUESTS, CAL_WARMUP = 8, 1


Span = tuple[int, int]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def profile(args: list[str], threads: int, log: Path) -> None:
    """``poise profile ARGS`` in its own process (its own torch, pinned threads)."""
    print("$ poise profile", " ".join(args), flush=True)
    with open(log, "w") as out:
        subprocess.run(
            [sys.executable, "-m", "poise", "profile", *args],
            cwd=REPO,
            env={**os.environ, **threads_env(threads)},
            check=True,
            stdout=out,
            stderr=out,
        )


def engine_config(engine: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(engine))


def server_spec(engine: list[str], threads: int, trace: Path) -> ServerSpec:
    """poise serve with the given engine flags (those that differ from the defaults), its step
    trace and no periodic log."""
    config = engine_config(engine).to_flat_dict()
    default = engine_config([]).to_flat_dict()
    args = {k: v for k, v in config.items() if k != "model" and v != default.get(k)}
    return ServerSpec(
        name="poise",
        model=config.get("model"),
        args={**args, "log_interval": 0, "step_trace": str(trace)},
        env=threads_env(threads),
        startup_timeout_s=600.0,
    )


def count_steps(trace: Path) -> int:
    """Steps written so far (read_trace's index of the next one)."""
    return sum(1 for line in trace.read_text().splitlines() if line.startswith('{"start_s"'))


def bench(base_url: str, spec: WorkloadSpec) -> ExperimentRecord:
    """One `poise bench` cell against the server (the bench's own runner, in this process)."""
    cfg = BenchConfig.for_workload(spec, base_url=base_url)
    record = asyncio.run(run_matrix(cfg))
    record.provenance["label"] = "measured"
    return record


@dataclasses.dataclass
class Run:
    """One run's folder and protocol: the workloads of its cells and where their files are."""

    a: argparse.Namespace
    out: Path

    @property
    def trace(self) -> Path:
        return self.out / "steps.jsonl"

    def load(self, c: int, seed: int = 0) -> WorkloadSpec:
        """Cell c of one round: per-stream counts x c, the seed mix at --long-ratio."""
        a = self.a
        return WorkloadSpec(
            concurrency=(c,),
            long_ratio=(a.long_ratio,),
            max_tokens=a.max_tokens,
            num_requests=a.requests_per_stream * c,
            warmup=a.warmup_per_stream * c,
            timeout_s=a.timeout,
            seed=seed,
        )

    def calibration(self) -> WorkloadSpec:
        """The c=1 cell: SHORT prompts only, short outputs."""
        return WorkloadSpec(
            concurrency=(1,),
            long_ratio=(0.0,),
            max_tokens=self.a.calibration_tokens,
            num_requests=CAL_REQUESTS,
            warmup=CAL_WARMUP,
            timeout_s=self.a.timeout,
        )

    def real(self, name: str, r: int) -> Path:
        return self.out / f"real-{name}-r{r}.yaml"


def measure(run: Run) -> tuple[dict[str, list[Span]], dict[str, list[float]], list[Path]]:
    """The profile slices and the rounds on one traced server: (spans, CPU shares, slices)."""
    a, out = run.a, run.out
    slices: list[Path] = []

    def profile_slice(i: int) -> None:
        path = out / f"profile-slice{i}.json"
        profile(
            [
                "--grid",
                a.profile_grid,
                "--repeats",
                str(a.profile_repeats),
                "--threads",
                str(a.threads),
                "--clock",
                a.profile_clock,
                "-o",
                str(path),
                *a.engine,
            ],
            a.threads,
            out / f"profile-slice{i}.log",
        )
        slices.append(path)

    spans: dict[str, list[Span]] = {}
    shares: dict[str, list[float]] = {}
    server: ManagedServer | None = None
    try:
        # With --calibrate a last c=1 cell closes the window, so every round's cells are
        # bracketed by a c=1 cell before and one after (the next round's).
        for r in range(a.rounds + 1 if a.calibrate else a.rounds):
            last = r == a.rounds
            if a.profile is None and not last:
                profile_slice(r)
            if server is None:
                server = ManagedServer(
                    server_spec(a.engine, a.threads, run.trace), out / "serve.log"
                )
                server.start().wait_ready()  # stopped in finally, whatever happens
            cells = [("cal", run.calibration())] if a.calibrate else []
            if not last:
                cells += [(f"c{c}", run.load(c)) for c in a.concs]
            for name, load in cells:
                assert server.pid is not None
                first, cpu0, w0 = count_steps(run.trace), cpu_seconds(server.pid), time.monotonic()
                print(f"round {r} {name}: bench {server.base_url}", flush=True)
                record = bench(server.base_url, load)
                span = (first, count_steps(run.trace))
                share = (cpu_seconds(server.pid) - cpu0) / (time.monotonic() - w0)
                # The record names its span of the trace: `poise simulate --calibrate-from`
                # reads the c=1 cells' step times from it.
                link_step_trace(record, run.trace.name, [span])
                record.save(run.real(name, r))
                spans.setdefault(name, []).append(span)
                shares.setdefault(name, []).append(share)
                print(f"round {r} {name}: the server got {share:.2f} of a core", flush=True)
        (out / "spans.json").write_text(json.dumps({"spans": spans, "shares": shares}))
    finally:
        if server is not None:
            server.stop()
    if a.profile is None:
        profile_slice(a.rounds)  # the last slice closes the window
    return spans, shares, slices
