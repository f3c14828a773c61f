"""Simulated vs measured: does `poise simulate` predict `poise bench` against `poise serve`?

For the seed workload (SHORT/LONG prompts, ``--long-ratio`` 0.25, ``--max-tokens`` 160,
closed loop at ``--concurrency`` 8, 16, 32) on the embedded SmolLM2 on this CPU:

1. a step-cost profile: ``--profile FILE``, or measured now with ``poise profile`` (by default
   ``--clock cpu``: the runner thread's CPU time, which a busy shared machine does not inflate;
   ``--calibrate`` then supplies the share of a core the server really gets);
2. the real run: ``poise serve`` (a subprocess on 127.0.0.1, a free port) and ``poise bench``
   against it, the same engine flags for both;
3. optionally (``--calibrate``) a small concurrency-1 cell of SHORT prompts, measured and
   simulated: the TPOT ratio gives a time scale (the server's steps run slower than the
   profiled runner's: streaming, detokenization and the asyncio loop compete for the CPU, and
   so does whatever else the machine runs now), and the rest of the TTFT gap the per-request
   overhead (HTTP, template, tokenization). Calibration uses a different load point from the
   compared cells;
4. the simulation of the same matrix, without and with the calibrated overheads;
5. a table of TTFT p50, TTFT p95 and output tokens/s, simulated vs measured, and the relative
   error; pass when all are within ``--tolerance`` (15 %).

Others may edit the tree while this runs (the server and the profile must run the same model
code): run it from a pinned copy, ``git archive HEAD | tar -x -C /tmp/snap`` then
``.venv/bin/python /tmp/snap/benchmarks/sim_vs_real.py``; the commit is recorded when known.

Torch threads are pinned (``--threads``, default 1) for both the profile and the server: on a
2-core machine shared with other work, oversubscribed OpenMP threads make step times erratic.

    .venv/bin/python benchmarks/sim_vs_real.py [--profile FILE] [--calibrate]
        [--concurrency 8,16,32] [--num-requests N] [--warmup W] [--max-tokens 160]
        [--requests-per-stream K] [--out-dir runs/sim_vs_real] [-- ENGINE FLAGS...]
    # simulate a finished run's measurements again, e.g. with another profile:
    .venv/bin/python benchmarks/sim_vs_real.py --reuse runs/sim_vs_real/<run> --profile P \
        --calibrate --concurrency 8,16,32 --requests-per-stream 1 --warmup-per-stream 0
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
POISE = [sys.executable, "-m", "poise"]
METRICS = ("p50_ttft_ms", "p95_ttft_ms", "output_tokens_per_s")


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env(threads: int) -> dict[str, str]:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = str(threads)
    e["MKL_NUM_THREADS"] = str(threads)
    return e


def run(cmd: list[str], threads: int, log: Path | None = None) -> None:
    print("$", " ".join(cmd[2:] if cmd[:2] == POISE[:2] else cmd), flush=True)
    out = open(log, "w") if log else None  # noqa: SIM115
    try:
        subprocess.run(cmd, cwd=REPO, env=env(threads), check=True, stdout=out, stderr=out)
    finally:
        if out:
            out.close()


def start_server(engine: list[str], threads: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    port = free_port()
    cmd = [*POISE, "serve", "--port", str(port), "--log-interval", "0", *engine]
    print("$ poise", " ".join(cmd[3:]), flush=True)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(threads), stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"poise serve exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError("poise serve did not become healthy")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()  # by PID: only the process this script started
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def load_args(a: argparse.Namespace, concurrency: str, long_ratio: str, n: int | None,
              warmup: int | None, max_tokens: int) -> list[str]:  # fmt: skip
    out = [
        "--concurrency",
        concurrency,
        "--long-ratio",
        long_ratio,
        "--max-tokens",
        str(max_tokens),
    ]
    if n is not None:
        out += ["--num-requests", str(n)]
    if warmup is not None:
        out += ["--warmup", str(warmup)]
    return out


def templates(path: Path) -> list[dict[str, Any]]:
    rec = yaml.safe_load(path.read_text())
    return list(rec["experiment"]["metrics"])


def overall(path: Path) -> list[dict[str, Any]]:
    rec = yaml.safe_load(path.read_text())
    return [c["metrics"]["overall"] for c in rec["results"]]


CALIBRATION = ["--concurrency", "1", "--long-ratio", "0", "--num-requests", "4", "--warmup", "1"]


def measure_calibration(a: argparse.Namespace, base: str, out: Path) -> None:
    """The concurrency-1 SHORT-prompt cell, measured (calibration-real.yaml)."""
    cal = [*CALIBRATION, "--max-tokens", str(a.calibration_tokens)]
    run([*POISE, "bench", "--base-url", base + "/v1", *cal, "--no-progress",
         "-o", str(out / "calibration-real.yaml")], a.threads, out / "calibration-bench.log")  # fmt: skip


def calibrate(a: argparse.Namespace, engine: list[str], out: Path) -> tuple[float, float, float]:
    """(request overhead s, time scale, step jitter CV): the measured calibration cell against
    its simulation."""
    cal = [*CALIBRATION, "--max-tokens", str(a.calibration_tokens)]
    sim = out / f"calibration-sim-{a.profile.stem}.yaml"
    run([*POISE, "simulate", "--profile", str(a.profile), *cal, "-o", str(sim), *engine],
        a.threads, out / "calibration-sim.log")  # fmt: skip
    r, s = overall(out / "calibration-real.yaml")[0], overall(sim)[0]
    # Decode steps dominate TPOT: their ratio is how much slower steps run now, in the server,
    # than the profile says.
    scale = r["tpot_ms"]["p50"] / s["tpot_ms"]["p50"]
    req = request_overhead(out / "calibration-real.requests.jsonl")
    cv = step_jitter(out / "calibration-real.requests.jsonl")
    print(f"calibration: time scale {scale:.3f}, request overhead {req * 1000:.1f} ms, "
          f"step jitter CV {cv:.3f}")  # fmt: skip
    return req, scale, cv


def step_jitter(requests_jsonl: Path) -> float:
    """Coefficient of variation of the inter-token gaps at concurrency 1 (after the first two
    tokens): steps of one shape, so their spread is the machine's, not the model's."""
    gaps: list[float] = []
    for line in requests_jsonl.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("warmup"):
            continue
        times = [t for t, chars in zip(rec["events"], rec["event_chars"], strict=False) if chars]
        gaps += [b - a for a, b in zip(times[1:], times[2:], strict=False)]
    if len(gaps) < 2:
        return 0.0
    mean = sum(gaps) / len(gaps)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    return var**0.5 / mean if mean > 0 else 0.0


def request_overhead(requests_jsonl: Path) -> float:
    """Median seconds from sending a request to its response headers, at concurrency 1.

    poise sends headers once the engine has taken the request; an idle engine takes it at once,
    so this is the request's way in (client, HTTP, template, tokenization). Measured directly
    rather than as "TTFT minus simulated prefill": that residual goes to 0 whenever the time
    scale overshoots, and a closed-loop request that reaches the engine at the very instant the
    previous one finished joins the step already under way instead of waiting for the next one,
    which takes a whole step off every simulated TTFT.
    """
    gaps = []
    for line in requests_jsonl.read_text().splitlines():
        rec = json.loads(line)
        if not rec.get("warmup") and rec.get("header") is not None:
            gaps.append(rec["header"] - rec["start"])
    if not gaps:
        raise RuntimeError(f"{requests_jsonl}: no response header times to calibrate from")
    gaps.sort()
    return gaps[len(gaps) // 2]


def compare(real: Path, sim: Path, tolerance: float) -> tuple[list[dict[str, Any]], bool]:
    rows, ok = [], True
    for r, s in zip(templates(real), templates(sim), strict=True):
        row: dict[str, Any] = {
            "concurrency": r["concurrency"],
            "long_ratio": r["long_prompt_ratio"],
        }
        for m in METRICS:
            rv, sv = r[m], s[m]
            err = (sv - rv) / rv if rv else None
            row[m] = {"real": rv, "sim": sv, "rel_error": err}
            ok = ok and err is not None and abs(err) <= tolerance
        rows.append(row)
    return rows, ok


def table(title: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"### {title}", "",
             "| c | long | TTFT p50 real / sim (ms) | err | TTFT p95 real / sim (ms) | err "
             "| out tok/s real / sim | err |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        cells = [str(row["concurrency"]), str(row["long_ratio"])]
        for m in METRICS:
            v = row[m]
            cells.append(f"{v['real']:.1f} / {v['sim']:.1f}")
            cells.append("-" if v["rel_error"] is None else f"{v['rel_error'] * 100:+.1f} %")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--profile", type=Path, default=None, help="Existing profile (else measure one)."
    )
    p.add_argument("--profile-grid", default="standard", choices=("quick", "standard"))
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument(
        "--profile-clock", choices=("wall", "cpu"), default="cpu",
        help="cpu (default): thread CPU time, then --calibrate scales it to the server's share.",
    )  # fmt: skip
    p.add_argument(
        "--reuse", type=Path, default=None,
        help="A finished run's folder: keep its measurements, simulate again (e.g. a new profile).",
    )  # fmt: skip
    p.add_argument("--concurrency", default="8,16,32")
    p.add_argument("--long-ratio", default="0.25")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument(
        "--num-requests", type=int, default=None, help="Measured per cell (bench default)."
    )
    p.add_argument("--warmup", type=int, default=None, help="Warmup per cell (bench default).")
    p.add_argument(
        "--requests-per-stream", type=int, default=None,
        help="Measured requests per cell = this x concurrency (overrides --num-requests).",
    )  # fmt: skip
    p.add_argument(
        "--warmup-per-stream", type=int, default=None,
        help="Warmup requests per cell = this x concurrency (overrides --warmup).",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calibrate", action="store_true", help="Calibrate overheads at concurrency 1.")
    p.add_argument("--calibration-tokens", type=int, default=32)
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument(
        "--timeout", type=float, default=3600.0,
        help="Per-request bench timeout, s (a CPU run of long prompts takes many minutes).",
    )  # fmt: skip
    p.add_argument("--out-dir", type=Path, default=REPO / "runs" / "sim_vs_real")
    p.add_argument(
        "engine", nargs=argparse.REMAINDER, help="-- then engine flags for serve/simulate."
    )
    a = p.parse_args()
    engine = [x for x in a.engine if x != "--"]
    out = a.reuse or a.out_dir / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if a.profile is None:
        a.profile = out / f"profile-{a.profile_clock}.json"
        run([*POISE, "profile", "--grid", a.profile_grid, "--repeats", str(a.profile_repeats),
             "--threads", str(a.threads), "--clock", a.profile_clock, "-o", str(a.profile),
             *engine], a.threads, out / "profile.log")  # fmt: skip
    concs = [int(x) for x in a.concurrency.split(",") if x.strip()]

    def load_for(c: int) -> list[str]:
        n = a.requests_per_stream * c if a.requests_per_stream else a.num_requests
        w = a.warmup_per_stream * c if a.warmup_per_stream is not None else a.warmup
        return load_args(a, str(c), a.long_ratio, n, w, a.max_tokens)

    shares: dict[int, float] = {}
    if a.reuse is None:
        proc, base = start_server(engine, a.threads, out / "serve.log")
        try:
            if a.calibrate:
                measure_calibration(a, base, out)
            for c in concs:
                cpu0, t_0 = cpu_seconds(proc.pid), time.monotonic()
                run([*POISE, "bench", "--base-url", base + "/v1", *load_for(c), "--no-progress",
                     "--timeout", str(a.timeout),
                     "-o", str(out / f"real-c{c}.yaml"), "--label", "measured"],
                    a.threads, out / f"bench-c{c}.log")  # fmt: skip
                share = (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t_0)
                shares[c] = share
                print(f"c={c}: the server got {share:.2f} of a core during the cell")
            (out / "server-cpu-share.json").write_text(json.dumps(shares))
        finally:
            stop_server(proc)
    req_s, scale, cv = calibrate(a, engine, out) if a.calibrate else (0.0, 1.0, 0.0)
    share_file = out / "server-cpu-share.json"
    if share_file.exists():
        shares = {int(k): v for k, v in json.loads(share_file.read_text()).items()}
    tag = a.profile.stem
    variants: dict[str, tuple[str, list[str]]] = {"profile only": (f"sim-{tag}", [])}
    if a.calibrate:
        variants["calibrated"] = (
            f"sim-calibrated-{tag}",
            ["--request-overhead-ms", f"{req_s * 1000:.3f}", "--time-scale", f"{scale:.4f}",
             "--step-jitter", f"{cv:.4f}"],
        )  # fmt: skip
    if a.calibrate and shares and all(c in shares for c in concs):
        # A cpu-clock profile scaled by the CPU share the server measurably got in each cell
        # (OS accounting, not latencies): the machine's contention, not the model, differs.
        variants["measured CPU share"] = (
            f"sim-share-{tag}",
            ["--request-overhead-ms", f"{req_s * 1000:.3f}", "--step-jitter", f"{cv:.4f}"],
        )
    for name, (stem, extra) in variants.items():
        for c in concs:
            if name == "measured CPU share":
                extra = [*variants[name][1], "--time-scale", f"{1 / shares[c]:.4f}"]
            run([*POISE, "simulate", "--profile", str(a.profile), *load_for(c), *extra,
                 "-o", str(out / f"{stem}-c{c}.yaml"), "--label", stem, *engine],
                a.threads, out / f"{stem}-c{c}.log")  # fmt: skip
    report: dict[str, Any] = {"out_dir": str(out), "profile": str(a.profile),
                              "commit": os.environ.get("POISE_COMMIT") or _commit(),
                              "calibration": {"request_overhead_s": req_s, "time_scale": scale,
                                              "step_jitter_cv": cv},
                              "server_cpu_share": shares,
                              "loads": {c: load_for(c) for c in concs}, "engine": engine,
                              "threads": a.threads}  # fmt: skip
    md = [f"# sim vs real ({time.strftime('%Y-%m-%d %H:%M')}, threads {a.threads}, "
          f"profile {a.profile.name})", ""]  # fmt: skip
    all_ok = True
    for name, (stem, _) in variants.items():
        rows = []
        ok = True
        speeds = []
        for c in concs:
            r, k = compare(out / f"real-c{c}.yaml", out / f"{stem}-c{c}.yaml", a.tolerance)
            rows += r
            ok = ok and k
            prov = yaml.safe_load((out / f"{stem}-c{c}.yaml").read_text())["provenance"]
            speeds.append(prov.get("simulated_requests_per_wall_s"))
        report[name] = {"rows": rows, "within_tolerance": ok, "sim_requests_per_wall_s": speeds}
        md += [table(f"{name}: {'PASS' if ok else 'FAIL'} at ±{a.tolerance:.0%}", rows), ""]
        all_ok = all_ok and ok
    report["wall_s"] = round(time.monotonic() - t0, 1)
    (out / f"report-{tag}.json").write_text(json.dumps(report, indent=1))
    (out / f"report-{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"results: {out}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
