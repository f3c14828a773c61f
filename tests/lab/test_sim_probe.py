"""The tuner against the simulator (real scheduler, virtual time): the lab -> sim bridge works
and its numbers move the way the scheduler says they must."""

from __future__ import annotations

import pytest

from poise.bench.bench_config import WorkloadSpec
from poise.cli import main
from poise.lab.probe import Candidate

# `poise tune --simulate` on the simulated H100 for the small workload both CLI tests run.
# The simulated accelerator and model shape (also tests/bench/test_vocabulary.py's).
SIM_H100_TUNE = [
    "tune",
    "--simulate",
    "--accelerator",
    "h100",
    "--model-shape",
    "Qwen2.5-7B-Instruct",
    "--device",
    "cuda",
]
SIM_TUNE = [
    *SIM_H100_TUNE,
    "--slo-ttft-p95-ms",
    "5000",
    "--concurrency",
    "8",
    "--max-tokens",
    "32",
    "--num-requests",
    "16",
]


def test_sim_probe_queueing_shows_in_ttft() -> None:
    from poise.cli.simulate import cost_model_from_args, prompt_lengths
    from poise.cli.tune import _simulate_defaults
    from poise.config import EngineConfig
    from poise.lab.live import SimProbe

    ns = _simulate_defaults()
    ns.accelerator, ns.model_shape = "h100", "Qwen2.5-7B-Instruct"
    base = {"device": "cuda"}
    cost = cost_model_from_args(ns, EngineConfig.from_kwargs(**base))
    work = WorkloadSpec(
        concurrency=(8,), long_ratio=(0.25,), max_tokens=32, num_requests=16, warmup=0
    )
    probe = SimProbe(base, work, work.cells()[0], cost, prompt_lengths(None))
    one = probe.measure(Candidate(2048, 1))
    eight = probe.measure(Candidate(2048, 8))
    assert one.note == "simulated" and one.num_errors == 0 and one.num_requests == 16
    # One slot for eight clients: each request waits for the ones ahead of it.
    assert one.ttft_p95_ms is not None and eight.ttft_p95_ms is not None
    assert one.ttft_p95_ms > 3 * eight.ttft_p95_ms
    assert (eight.output_tokens_per_s or 0) > 2 * (one.output_tokens_per_s or 0)


def test_tune_cli_simulate(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    search = ["--budgets", "1024,2048", "--seqs", "4,8", "--no-latency-search"]
    argv = [*SIM_TUNE, *search, "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Throughput-first: budget" in out and "poise serve --device cuda" in out


def test_tune_cli_simulate_runs_the_slo_phase_on_the_real_scheduler(tmp_path: object) -> None:
    """Policy slo, classes, shares and the controller through the simulator: every probe of
    the phase measured (no error), the classes reach the scheduler (requests are classed)."""
    import json
    from pathlib import Path

    slo_flags = ["--slo-tpot-p50-ms", "80", "--long-ratio", "0.5", "--no-policies"]
    search = ["--budgets", "1024,2048", "--seqs", "8", "--no-latency-search"]
    argv = [*SIM_TUNE, *slo_flags, *search, "--out", str(tmp_path)]
    main(argv)
    record = json.loads((Path(str(tmp_path)) / "tune.json").read_text())
    slo = [e for e in record["evidence"] if e["phase"] == "slo"]
    # policy slo, the shares 0.5 and 0.9 (0.7 is the default set's own), three controller targets
    assert len(slo) == 1 + 2 + 3
    assert all(e["error"] is None and e["metrics"]["num_requests"] > 0 for e in slo)
    assert {e["args"]["scheduling_policy"] for e in slo} == {"slo"}
    assert any(e["args"].get("token_budget_controller") for e in slo)
