"""Simulated vs measured: does `poise simulate` predict `poise bench` against `poise serve`?

For the seed workload (SHORT/LONG prompts, ``--long-ratio`` 0.25, ``--max-tokens`` 160,
closed loop at ``--concurrency`` 8, 16, 32) on the embedded SmolLM2 on this CPU.

A thin driver of the lab's own pieces: the server is ``poise.lab.managed_server.ManagedServer``, the
load is ``poise.bench.runner.run_matrix`` (what `poise bench` runs), the simulations are
``poise.lab.sim_bridge.simulate_matrix`` (what `poise simulate` runs) and the calibration is
``poise.sim.calibrate`` read from the bench records by ``poise.lab.calibration`` (what
`poise simulate --calibrate-from` runs). Only the protocol and the report are here: the
measured side in sim_vs_real_measure.py, the simulated one in sim_vs_real_predict.py, the
comparison and tables in sim_vs_real_report.py.

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
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sim_vs_real_measure import REPO, Run, engine_config, measure, profile
from sim_vs_real_predict import PRIMARY, Flags, calibrated_variants, simulate
from sim_vs_real_report import by_class, class_table, judge, spread_table

from poise.lab.calibration import pooled_metrics
from poise.sim.arrival import ArrivalModel
from poise.sim.fit import load_profile
from poise.sim.trace import predicted_vs_measured, read_trace


def _commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return None
    return done.stdout.strip() or None


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


if __name__ == "__main__":
    sys.exit(main())
