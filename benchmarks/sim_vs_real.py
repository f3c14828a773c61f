"""Simulated vs measured: does `poise simulate` predict `poise bench` against `poise serve`?

For the seed workload (SHORT/LONG prompts, ``--long-ratio`` 0.25, ``--max-tokens`` 160,
closed loop at ``--concurrency`` 8, 16, 32) on the embedded SmolLM2 on this CPU.

A thin driver of the lab's own pieces: the server is ``poise.lab.managed_server.ManagedServer``, the
load is ``poise.bench.runner.run_matrix`` (what `poise bench` runs), the simulations are
``poise.lab.sim_bridge.simulate_matrix`` (what `poise simulate` runs) and the calibration is
``poise.sim.calibrate`` read from the bench records by ``poise.lab.calibration`` (what
`poise simulate --calibrate-from` runs). Only the protocol and the report are here.

A shared 2-core machine drifts by tens of percent over minutes, as much as the tolerance, so
the run is built so that the profile and the measurements see the same machine:

1. ``--rounds`` R rounds. Each is a ``poise profile`` slice (the runner alone, ``--clock cpu``:
   the runner thread's CPU time) followed, on one ``poise serve`` (started with
   ``--step-trace``), by the cells: optionally (``--calibrate``) a concurrency-1 cell of SHORT
   prompts, then each concurrency with ``--requests-per-stream`` x c measured requests. Each
   cell's record links its span of the step trace (``artifacts.step_trace``). A last profile
   slice closes the window; ``poise profile --merge`` makes one profile of the whole window.
2. Real metrics are pooled over the rounds (``poise.lab.calibration.pooled_metrics``: TTFT
   percentiles over all measured requests, tokens/s as all tokens over all windows); the
   report also shows each round's deviation from the pooled value, the measurement's noise.
3. The step trace gives, per cell, the server's measured step times over the merged profile's
   predictions for the same steps: how fast the machine really was under each load.
4. Simulations of the same matrix, one per round as the rounds were measured. Calibration
   reads only the c=1 cells and facts of the server, never a compared cell
   (docs/simulator.md, Calibration):
   - request overhead: the median response-header latency at c=1;
   - the way in: poise serve renders the chat template and tokenizes on ONE thread, in
     arrival order; its time per prompt token is timed here with the server's own functions
     on the seed prompts (``way_in_workers`` 1). A burst (a closed loop's start, a wave coming
     back) thus reaches the engine in send order, which decides the loop's first waves;
   - time scale and step jitter from the c=1 cell's step trace (measured over predicted: its
     ratio, and its CV); round r takes the mean of the c=1 cells before and after it.
   Variants: *profile only*; the **primary** one above (the target is judged on it);
   *TPOT scale*, the same from the c=1 client records alone (TPOT over the profile's decode
   step, inter-token gap CV); *independent way in* (each request delayed on its own, spread by
   the c=1 CV); and *diagnostic*, each cell scaled by its own step-trace ratio: not a
   prediction, but what is left of the error once step times are right.
5. Tables of TTFT p50, TTFT p95 and output tokens/s, simulated vs measured, with the relative
   error.
6. The simulator is stochastic (step jitter): the calibrated variants are simulated with
   ``--sim-seeds`` seeds and the median over seeds is compared, with the seeds' range shown.
   Exit 0 when the primary variant's median is within ``--tolerance`` (15 %) in every cell.

Others may edit the tree while this runs (the server and the profile must run the same model
code): run it from a pinned copy, ``git archive HEAD | tar -x -C /tmp/snap`` then
``.venv/bin/python /tmp/snap/benchmarks/sim_vs_real.py``; the commit is recorded when known.

Torch threads are pinned (``--threads``, default 1) for both the profile and the server: on a
2-core machine shared with other work, oversubscribed OpenMP threads make step times erratic.

    .venv/bin/python benchmarks/sim_vs_real.py [--profile FILE] [--calibrate] [--rounds 3]
        [--concurrency 8,16,32] [--requests-per-stream 2] [--warmup-per-stream 1]
        [--max-tokens 160] [--out-dir runs/sim_vs_real] [-- ENGINE FLAGS...]
    # simulate a finished run's measurements again (e.g. after a cost-model change):
    .venv/bin/python benchmarks/sim_vs_real.py --reuse runs/sim_vs_real/<run> --calibrate \
        --rounds R --requests-per-stream K --warmup-per-stream W [-- ENGINE FLAGS...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from poise.bench.bench_config import BenchConfig, WorkloadSpec
from poise.bench.record import ExperimentRecord
from poise.bench.runner import run_matrix
from poise.cli.options import add_engine_args, engine_config_from_args
from poise.config import EngineConfig
from poise.lab.calibration import calibration_cells, link_step_trace, pooled_metrics
from poise.lab.managed_server import ManagedServer, ServerSpec
from poise.lab.sim_bridge import simulate_matrix
from poise.sim import calibrate as cal
from poise.sim.arrival import ArrivalModel
from poise.sim.cost import CostModel
from poise.sim.fit import load_profile
from poise.sim.tokens import PromptLengths
from poise.sim.trace import predicted_vs_measured, read_trace

REPO = Path(__file__).resolve().parents[1]
METRICS = ("p50_ttft_ms", "p95_ttft_ms", "output_tokens_per_s")
# The prediction the target is judged on (its median over --sim-seeds seeds): calibrated only
# from the c=1 cell, with the server's way in as it is.
PRIMARY = "calibrated per round (c=1 step-trace scale and jitter)"
CAL_REQUESTS, CAL_WARMUP = 8, 1
Span = tuple[int, int]


def _commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return None
    return done.stdout.strip() or None


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


def way_in_s_per_token(config: EngineConfig) -> float:
    """Seconds per prompt token that poise serve's one tokenizer thread spends on a seed
    request (chat template + tokenization), timed with the server's own functions. A machine
    fact, not fitted to any cell."""
    from poise.text.tokenizer import apply_chat_template, load_tokenizer
    from poise.workload import seed_classes

    tok = load_tokenizer(config.model.tokenizer or config.model.model)

    def job(prompt: str) -> Callable[[], int]:
        return lambda: len(apply_chat_template(tok, [{"role": "user", "content": prompt}]))

    return cal.time_per_token([job(c.prompt or "") for c in seed_classes()])


def simulate(
    spec: WorkloadSpec,
    config: EngineConfig,
    model: CostModel,
    arrival: ArrivalModel,
    out: Path,
    label: str,
) -> Path:
    cfg = BenchConfig.for_workload(spec, base_url="simulated://", model=model.name, scrape=False)
    record = simulate_matrix(cfg, config, model, PromptLengths(), arrival)
    record.provenance["label"] = label
    return record.save(out)


def rel(sim: float, real: float) -> float | None:
    return (sim - real) / real if real else None


def compare(
    real: dict[str, Any], sim: dict[str, Any], tolerance: float
) -> tuple[dict[str, Any], bool]:
    row: dict[str, Any] = {}
    ok = True
    for m in METRICS:
        err = rel(sim[m], real[m])
        lo = min(r[m] for r in real["rounds"])
        hi = max(r[m] for r in real["rounds"])
        row[m] = {"real": real[m], "sim": sim[m], "rel_error": err, "real_rounds": [lo, hi]}
        ok = ok and err is not None and abs(err) <= tolerance
    return row, ok


def table(title: str, rows: dict[int, dict[str, Any]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| c | TTFT p50 real / sim (ms) | err | TTFT p95 real / sim (ms) | err "
        "| out tok/s real / sim | err |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, row in rows.items():
        cells = [str(c)]
        for m in METRICS:
            v = row[m]
            cells.append(f"{v['real']:.1f} / {v['sim']:.1f}")
            cells.append("-" if v["rel_error"] is None else f"{v['rel_error'] * 100:+.1f} %")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def band_table(title: str, rows: dict[int, dict[str, Any]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| c | TTFT p50 real / sim median [seed range] (ms) | err | TTFT p95 real / sim "
        "median [range] (ms) | err | out tok/s real / sim median [range] | err |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, row in rows.items():
        cells = [str(c)]
        for m in METRICS:
            v = row[m]
            lo, hi = v["sim_seeds"]
            mark = "" if v["real_in_band"] else " (real outside)"
            cells.append(f"{v['real']:.1f} / {v['sim']:.1f} [{lo:.0f}-{hi:.0f}]{mark}")
            cells.append("-" if v["rel_error"] is None else f"{v['rel_error'] * 100:+.1f} %")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_table(real: dict[int, dict[str, Any]]) -> str:
    """Each round's value against the pooled one: the measurement's own noise."""
    lines = [
        "### the real runs, round by round (pooled value; each round's deviation)",
        "",
        "| c | TTFT p50 | TTFT p95 | out tok/s |",
        "|---|---|---|---|",
    ]
    for c, r in real.items():
        cells = [str(c)]
        for m in METRICS:
            devs = ", ".join(f"{(x[m] / r[m] - 1) * 100:+.0f}" for x in r["rounds"])
            cells.append(f"{r[m]:.1f} ({devs} %)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def by_class(paths: list[Path]) -> dict[str, dict[str, float]]:
    """Per request class: admission (send to response headers: the way in plus the wait for
    the step under way) and TTFT, p50 in ms, over the measured requests of ``paths``."""
    from poise.bench.record import ExperimentRecord
    from poise.bench.stats import derive, percentile

    out: dict[str, dict[str, list[float]]] = {}
    for p in paths:
        for r in ExperimentRecord.load(p).cells[0].records:
            if r.warmup or not r.ok:
                continue
            d = out.setdefault(r.class_name, {"header": [], "ttft": []})
            if r.header is not None:
                d["header"].append((r.header - r.start) * 1000)
            ttft = derive(r).ttft
            if ttft is not None:
                d["ttft"].append(ttft * 1000)
    return {
        cls: {k: percentile(v, 50) or float("nan") for k, v in d.items()} | {"n": len(d["ttft"])}
        for cls, d in sorted(out.items())
    }


def class_table(title: str, rows: dict[int, tuple[dict[str, Any], dict[str, Any]]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| c | class | n | admission p50 real / sim (ms) | TTFT p50 real / sim (ms) |",
        "|---|---|---|---|---|",
    ]
    for c, (real, sim) in rows.items():
        for cls, r in real.items():
            s = sim.get(cls, {})
            lines.append(
                f"| {c} | {cls} | {r['n']} | {r['header']:.0f} / {s.get('header', float('nan')):.0f}"
                f" | {r['ttft']:.0f} / {s.get('ttft', float('nan')):.0f} |"
            )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="Existing profile (else measured now, in slices that bracket the rounds).",
    )
    p.add_argument("--profile-grid", default="standard", choices=("quick", "standard"))
    p.add_argument("--profile-repeats", type=int, default=2, help="Repeats per profile slice.")
    p.add_argument(
        "--profile-clock",
        choices=("wall", "cpu"),
        default="cpu",
        help="cpu (default): the runner thread's CPU time.",
    )
    p.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="A finished run's folder: keep its measurements, simulate again (e.g. a new profile).",
    )
    p.add_argument("--rounds", type=int, default=3, help="Measurement rounds, pooled.")
    p.add_argument("--concurrency", default="8,16,32")
    p.add_argument("--long-ratio", type=float, default=0.25)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument(
        "--requests-per-stream",
        type=int,
        default=2,
        help="Measured requests per cell and round = this x concurrency.",
    )
    p.add_argument(
        "--warmup-per-stream",
        type=int,
        default=1,
        help="Warmup requests per cell and round = this x concurrency.",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calibrate", action="store_true", help="Calibrate overheads at concurrency 1.")
    p.add_argument("--calibration-tokens", type=int, default=32)
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument(
        "--sim-seeds",
        type=int,
        default=8,
        help="Simulate the calibrated variants with this many seeds; compare the median.",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="Per-request bench timeout, s (a CPU run of long prompts takes many minutes).",
    )
    p.add_argument("--out-dir", type=Path, default=REPO / "runs" / "sim_vs_real")
    p.add_argument(
        "engine", nargs=argparse.REMAINDER, help="-- then engine flags for serve/simulate."
    )
    a = p.parse_args()
    a.engine = [x for x in a.engine if x != "--"]
    a.concs = [int(x) for x in a.concurrency.split(",") if x.strip()]
    return a


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


Flags = Callable[[int, int], tuple[CostModel, ArrivalModel]]  # (concurrency, round) -> models


def calibrated_variants(
    run: Run, model: CostModel, speed_rounds: dict[str, list[float]]
) -> tuple[list[tuple[str, str, Flags, int]], dict[str, Any]]:
    """The calibrated variants (name, tag, models per cell and round, seeds) and what they
    were calibrated to."""
    a = run.a
    # Every c=1 cell: one per round and one closing the window (runs from before it: none).
    paths = [run.real("cal", r) for r in range(a.rounds + 1) if run.real("cal", r).exists()]
    cells = [c for p in paths for c in calibration_cells(p)]
    pooled = cal.calibrate(model, cells)
    n = a.rounds
    # Round r's cells ran between c=1 cells r and r+1: each value is the mean of the two.
    trace_scales = cal.bracket([cal.trace_time_scale(model, c.steps or ()) for c in cells], n)
    trace_cvs = cal.bracket([cal.trace_step_jitter(model, c.steps or ()) for c in cells], n)
    tpot_scales = cal.bracket([cal.tpot_time_scale(model, c.requests) for c in cells], n)
    gap_cvs = cal.bracket([cal.gap_jitter(c.requests) for c in cells], n)
    way_in = way_in_s_per_token(engine_config(a.engine))
    # poise serve's way in as it is: the client and HTTP part of the overhead overlaps, the
    # chat template and tokenization run on one thread, in arrival order.
    queued = ArrivalModel(pooled.request_overhead_s, 0.0, 1, way_in)
    independent = ArrivalModel(pooled.request_overhead_s, pooled.request_overhead_cv)

    def timed(scale: float, cv: float) -> CostModel:
        return dataclasses.replace(model, time_scale=scale, step_jitter_cv=cv)

    variants: list[tuple[str, str, Flags, int]] = [
        (
            PRIMARY,
            "trace",
            lambda c, r: (timed(trace_scales[r], trace_cvs[r]), queued),
            a.sim_seeds,
        ),
        (
            "calibrated (c=1 TPOT scale, client gaps' jitter)",
            "tpot",
            lambda c, r: (timed(tpot_scales[r], gap_cvs[r]), queued),
            a.sim_seeds,
        ),
        (
            "calibrated (c=1 step-trace scale), independent way in",
            "random",
            lambda c, r: (timed(trace_scales[r], trace_cvs[r]), independent),
            a.sim_seeds,
        ),
        (
            "diagnostic: each cell's own step-trace scale",
            "oracle",
            lambda c, r: (timed(speed_rounds[f"c{c}"][r], trace_cvs[r]), queued),
            1,
        ),
    ]
    facts = {
        "request_overhead_s": pooled.request_overhead_s,
        "request_overhead_cv": pooled.request_overhead_cv,
        "way_in_s_per_token": way_in,
        "trace_scale_by_round": trace_scales,
        "trace_step_jitter_cv_by_round": trace_cvs,
        "tpot_scale_by_round": tpot_scales,
        "gap_jitter_cv_by_round": gap_cvs,
        "real_c1": pooled_metrics(paths),
    }
    print(
        f"calibration: request overhead {pooled.request_overhead_s * 1000:.1f} ms (CV "
        f"{pooled.request_overhead_cv:.2f}), way in {way_in * 1e6:.2f} us/token on one thread; "
        f"per round: step-trace scale {', '.join(f'{x:.3f}' for x in trace_scales)} (jitter CV "
        f"{', '.join(f'{x:.3f}' for x in trace_cvs)}), TPOT scale "
        f"{', '.join(f'{x:.3f}' for x in tpot_scales)}"
    )
    return variants, facts


def main() -> int:
    a = parse_args()
    run = Run(a, a.reuse or a.out_dir / time.strftime("%Y%m%d-%H%M%S"))
    out = run.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    concs, rounds = a.concs, range(a.rounds)
    if a.reuse is None:
        spans, shares, slices = measure(run)
    else:
        saved = json.loads((out / "spans.json").read_text())
        spans = {k: [(int(x), int(y)) for x, y in v] for k, v in saved["spans"].items()}
        shares, slices = saved["shares"], sorted(out.glob("profile-slice*.json"))
    if a.profile is None:
        a.profile = out / "profile-merged.json"
        profile(
            ["--merge", *map(str, slices), "-o", str(a.profile)],
            a.threads,
            out / "profile-merge.log",
        )
    model = load_profile(a.profile)
    config = engine_config(a.engine)
    real = {c: pooled_metrics([run.real(f"c{c}", r) for r in rounds]) for c in concs}
    # Step times on the server against the profile, per cell: how fast the machine really
    # was while each load ran (a diagnostic: no prediction below uses a compared cell's steps).
    _, steps = read_trace(run.trace)
    speed = {
        name: predicted_vs_measured(model, [s for x, y in sp for s in steps[x:y]]).to_dict()
        for name, sp in spans.items()
    }
    speed_rounds = {
        name: [predicted_vs_measured(model, steps[x:y]).ratio for x, y in sp]
        for name, sp in spans.items()
    }
    report: dict[str, Any] = {
        "out_dir": str(out),
        "profile": str(a.profile),
        "profile_slices": [str(x) for x in slices],
        "commit": os.environ.get("POISE_COMMIT") or _commit(),
        "rounds": a.rounds,
        "server_cpu_share": shares,
        "step_time_vs_profile": speed,
        "step_time_vs_profile_by_round": speed_rounds,
        "engine": a.engine,
        "threads": a.threads,
        "real": real,
    }
    # Each round is simulated as it was measured (its requests, its warm-up, a fresh closed
    # loop) with the calibration of the c=1 cells around it, and the rounds are pooled like
    # the real ones: the machine's speed moves between rounds.
    variants: list[tuple[str, str, Flags, int]] = [
        ("profile only", "plain", lambda c, r: (model, ArrivalModel()), 1)
    ]
    if a.calibrate:
        calibrated, report["calibration"] = calibrated_variants(run, model, speed_rounds)
        variants += calibrated

    def simulate_cell(tag: str, name: str, c: int, models: Flags, seed: int) -> list[Path]:
        """One simulated measurement of cell c: a simulation per round, as the real rounds."""
        return [
            simulate(
                run.load(c, seed=seed * 100 + r),
                config,
                *models(c, r),
                out / f"sim-{tag}-{a.profile.stem}-c{c}-r{r}-seed{seed}.yaml",
                name,
            )
            for r in rounds
        ]

    md = [
        f"# sim vs real ({time.strftime('%Y-%m-%d %H:%M')}, threads {a.threads}, "
        f"{a.rounds} rounds x {a.requests_per_stream} requests per stream, "
        f"profile {a.profile.name})",
        "",
    ]
    md += [
        "### step time on the server / profile prediction, per cell (rounds; pooled wall, CPU)",
        "",
        "| cell | rounds | pooled wall | pooled CPU | server CPU share |",
        "|---|---|---|---|---|",
    ]
    for name, d in speed.items():
        rs = ", ".join(f"{x:.3f}" for x in speed_rounds[name])
        cpu = "-" if d["cpu_ratio"] is None else f"{d['cpu_ratio']:.3f}"
        sh = ", ".join(f"{x:.2f}" for x in shares.get(name, []))
        md.append(f"| {name} | {rs} | {d['ratio']:.3f} | {cpu} | {sh} |")
    md += ["", spread_table(real), ""]
    target_ok: bool | None = None
    for name, tag, models, n_seeds in variants:
        by_seed = {
            c: [simulate_cell(tag, name, c, models, seed) for seed in range(n_seeds)] for c in concs
        }
        section, ok = judge(name, real, by_seed, a.tolerance)
        report[name] = section
        report[name]["models_round0"] = {c: [m.describe() for m in models(c, 0)] for c in concs}
        md += section.pop("md")
        if tag == "trace":
            classes = {
                c: (by_class([run.real(f"c{c}", r) for r in rounds]), by_class(by_seed[c][0]))
                for c in concs
            }
            report[name]["by_class"] = classes
            md += [class_table(f"{name}, by request class", classes), ""]
        if name == PRIMARY:
            target_ok = ok
    report["target"] = {
        "variant": PRIMARY,
        "median_of_seeds": a.sim_seeds > 1,
        "within_tolerance": target_ok,
    }
    md.insert(
        2,
        f"**Target** ({PRIMARY}, median of {a.sim_seeds} seeds) within "
        f"±{a.tolerance:.0%}: **{'PASS' if target_ok else 'FAIL'}**\n",
    )
    report["wall_s"] = round(time.monotonic() - t0, 1)
    (out / f"report-{a.profile.stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"report-{a.profile.stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"results: {out}")
    return 0 if target_ok else 1


def judge(
    name: str, real: dict[int, Any], by_seed: dict[int, list[list[Path]]], tolerance: float
) -> tuple[dict[str, Any], bool]:
    """One variant against the real cells: seed 0's table and, with several seeds, the median
    over seeds with their range. Returns (report section with its markdown, within tolerance:
    of the median when seeded, else of seed 0)."""
    seeded = {c: [pooled_metrics(paths) for paths in runs] for c, runs in by_seed.items()}
    rows, ok = {}, True
    for c in seeded:
        rows[c], k = compare(real[c], seeded[c][0], tolerance)
        ok = ok and k
    speeds = [
        yaml.safe_load(runs[0][0].read_text())["provenance"].get("simulated_requests_per_wall_s")
        for runs in by_seed.values()
    ]
    section: dict[str, Any] = {
        "rows": rows,
        "within_tolerance": ok,
        "sim_requests_per_wall_s": speeds,
    }
    md = [table(f"{name}, seed 0: {'PASS' if ok else 'FAIL'} at ±{tolerance:.0%}", rows), ""]
    n_seeds = len(next(iter(seeded.values())))
    if n_seeds > 1:
        # The simulator is stochastic (step jitter): its prediction is a distribution. Seed 0
        # above is one draw; the median over seeds is the point estimate, the band says how
        # far one run of this size can fall from it.
        band_rows, ok = {}, True
        for c in seeded:
            med = {m: statistics.median(d[m] for d in seeded[c]) for m in METRICS}
            row, k = compare(real[c], med, tolerance)
            for m in METRICS:
                vals = [d[m] for d in seeded[c]]
                row[m]["sim_seeds"] = [min(vals), max(vals)]
                row[m]["real_in_band"] = min(vals) <= real[c][m] <= max(vals)
            band_rows[c], ok = row, ok and k
        section["seeds"] = {"n": n_seeds, "rows": band_rows, "within_tolerance": ok}
        md += [
            band_table(
                f"{name}, median over {n_seeds} simulator seeds: "
                f"{'PASS' if ok else 'FAIL'} at ±{tolerance:.0%}",
                band_rows,
            ),
            "",
        ]
    section["md"] = md
    return section, ok


if __name__ == "__main__":
    sys.exit(main())
