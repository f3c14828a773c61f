"""The tuner over HTTP: each probed config starts the scripted engine (a subprocess, via a
command template), the bench measures it, the server is stopped. TTFT p95 is a known function
of the token budget (40 / 113 / 320 ms for 512 / 1024 / 2048), wide apart from the SLOs used,
so the answers do not depend on this machine's speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poise.bench.bench_config import WorkloadSpec
from poise.lab.live import LiveProbe
from poise.lab.managed_server import ServerSpec
from poise.lab.tune import Tuner, TuneSettings
from tests.lab.conftest import MOCK_TEMPLATE, pid_gone


def probe_for(tmp_path: Path, workload: WorkloadSpec, extra: str = "") -> LiveProbe:
    spec = ServerSpec("mock", command=MOCK_TEMPLATE + extra, startup_timeout_s=30, grace_s=2)
    return LiveProbe(spec, workload, workload.cells()[0], tmp_path)


def settings(slo: float) -> TuneSettings:
    # As `poise tune --command-template` sets them: the scripted engine takes no policy.
    return TuneSettings(
        slo, budgets=(512, 1024, 2048), seqs=(4,), try_policies=False, slo_scheduling=False
    )


def test_tune_over_http_finds_the_largest_budget_within_slo(
    tmp_path: Path, tiny_workload: WorkloadSpec
) -> None:
    probe = probe_for(tmp_path, tiny_workload)
    result = Tuner(probe, settings(200.0)).run()
    assert result.throughput_first is not None and result.latency_first is not None
    assert result.throughput_first.candidate.max_num_batched_tokens == 1024
    assert result.latency_first.candidate.max_num_batched_tokens == 512
    assert any(
        d.startswith("budget 1024 -> 2048") and "> SLO 200 ms: back off" in d
        for d in result.decisions
    )
    # One server per probed config, every one of them stopped.
    assert len(probe.pids) == 3 and all(pid_gone(p) for p in probe.pids)
    # Resume: a second tuner on the same folder measures nothing again.
    again = probe_for(tmp_path, tiny_workload)
    result2 = Tuner(again, settings(200.0)).run()
    assert again.pids == []
    assert result2.throughput_first is not None
    assert result2.throughput_first.candidate.max_num_batched_tokens == 1024


def test_tune_over_http_reports_no_config_meets_slo(
    tmp_path: Path, tiny_workload: WorkloadSpec
) -> None:
    result = Tuner(probe_for(tmp_path, tiny_workload), settings(20.0)).run()
    assert not result.met and result.closest is not None
    assert result.closest.candidate.max_num_batched_tokens == 512


def test_failing_cells_leave_no_process(tmp_path: Path, tiny_workload: WorkloadSpec) -> None:
    probe = probe_for(tmp_path, tiny_workload, " --fail-requests")
    result = Tuner(probe, settings(200.0)).run()
    assert not result.met
    assert result.evidence and all(e.error for e in result.evidence)
    assert probe.pids and all(pid_gone(p) for p in probe.pids)


def test_tune_cli_against_a_command_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from poise.cli import main

    argv = [
        "tune",
        "--slo-ttft-p95-ms",
        "200",
        "--command-template",
        MOCK_TEMPLATE,
        "--budgets",
        "512,1024,2048",
        "--seqs",
        "4",
        "--concurrency",
        "4",
        "--max-tokens",
        "32",
        "--num-requests",
        "8",
        "--warmup",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "does not pass scheduling_policy: not tuned" in out
    assert "Throughput-first: budget 1024 / seqs 4 (probe #2)" in out
    assert "--port 8000 --max-num-batched-tokens 1024 --max-num-seqs 4" in out
    record = json.loads((tmp_path / "tune.json").read_text())
    assert record["met"] and record["throughput_first"]["args"]["max_num_batched_tokens"] == 1024
    assert record["workload"]["concurrency"] == [4] and len(record["evidence"]) == 3
    assert (tmp_path / "tune.md").is_file()
