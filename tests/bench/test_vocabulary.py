"""One lab vocabulary: the workload flags of `poise bench` (generated from WorkloadSpec), the
open-loop cap, base URLs with or without /v1, and old spellings as deprecated aliases."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from poise.bench.bench_config import BenchConfig, WorkloadSpec, api_root, server_root
from poise.cli import build_parser, main
from tests.lab.test_sim_probe import SIM_H100_TUNE


def bench_config(argv: list[str]) -> BenchConfig:
    from poise.cli.bench import config_from_args

    cfg = config_from_args(build_parser().parse_args(["bench", *argv]))
    assert isinstance(cfg, BenchConfig)
    return cfg


def test_open_loop_rates_have_no_default_cap() -> None:
    cfg = bench_config(["--base-url", "http://h:1/v1", "--request-rate", "2,4"])
    assert [(c.concurrency, c.request_rate) for c in cfg.cells()] == [(None, 2.0), (None, 4.0)]
    capped = bench_config(["--base-url", "http://h:1", "--request-rate", "2", "--concurrency", "3"])
    assert [c.label for c in capped.cells()] == ["r2-cap3-long0"]
    # A closed loop without --concurrency still gets the default streams.
    assert [c.concurrency for c in WorkloadSpec().cells()] == [8]
    mixed = WorkloadSpec(request_rate=(2.0, math.inf))
    assert [c.concurrency for c in mixed.cells()] == [None, 8]


def test_open_loop_sends_more_than_eight_at_once(mock: Any, tmp_path: Path) -> None:
    """The bug: `--request-rate` alone capped every cell at 8 requests in flight."""
    srv = mock(ttft=0.6, tpot=0.001)
    out = tmp_path / "r.yaml"
    root = srv.base_url.removesuffix("/v1")  # the server's root: /v1 is added
    argv = [
        "bench",
        "--base-url",
        root,
        "--request-rate",
        "200",
        "--num-requests",
        "20",
        "--warmup",
        "0",
        "--max-tokens",
        "2",
        "--no-scrape",
        "--no-progress",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    assert srv.state.peak_running > 8
    cell = yaml.safe_load(out.read_text())["results"][0]
    assert cell["load"]["label"] == "r200-long0" and cell["load"]["concurrency"] is None
    assert cell["metrics"]["overall"]["num_ok"] == 20


def test_base_url_with_or_without_v1() -> None:
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert api_root(url) == "http://h:8000/v1"
        assert server_root(url) == "http://h:8000"
        assert BenchConfig(base_url=url).metrics_endpoint() == "http://h:8000/metrics"
    # Another mount point is kept as given.
    assert api_root("http://h/openai/v1") == "http://h/openai/v1"
    assert api_root("http://h/api/") == "http://h/api"
    from poise.lab.managed_server import ServerSpec

    assert ServerSpec("x", base_url="http://127.0.0.1:{port}").url(9) == "http://127.0.0.1:9/v1"


def test_old_spellings_work_and_say_they_are_deprecated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = bench_config(
        [
            "--base-url",
            "http://h:1",
            "--seed",
            "3",
            "--timeout",
            "30",
            "--slo-ttft-ms",
            "500,long=5000",
            "--slo-tpot-ms",
            "40",
        ]
    )
    assert cfg.seed == 3 and cfg.timeout_s == 30.0
    assert cfg.slo_ttft_ms == 500 and cfg.class_slo_ttft_ms == {"long": 5000.0}
    assert cfg.slo_tpot_ms == 40
    err = capsys.readouterr().err
    for old, new in (
        ("--seed", "--workload-seed"),
        ("--timeout", "--request-timeout"),
        ("--slo-ttft-ms", "--slo-ttft-p95-ms"),
        ("--slo-tpot-ms", "--slo-tpot-p50-ms"),
    ):
        assert f"poise bench: {old} is deprecated, use {new}" in err
    new = bench_config(
        [
            "--base-url",
            "http://h:1",
            "--workload-seed",
            "3",
            "--request-timeout",
            "30",
            "--slo-ttft-p95-ms",
            "500,long=5000",
            "--slo-tpot-p50-ms",
            "40",
        ]
    )
    assert new == cfg and capsys.readouterr().err == ""
    args = build_parser().parse_args(["simulate", "--output", "x.yaml", "--plot"])
    assert args.out == "x.yaml" and args.plots is True
    assert "--output is deprecated" in capsys.readouterr().err
    args = build_parser().parse_args(["sweep", "--preset", "lab", "--threads", "2"])
    assert args.omp_num_threads == 2
    assert "poise sweep: --threads is deprecated, use --omp-num-threads" in capsys.readouterr().err


def test_every_lab_command_takes_the_same_workload_flags() -> None:
    common = [
        "--class",
        "chat:1:20:8",
        "--request-rate",
        "5",
        "--concurrency",
        "2",
        "--workload-seed",
        "7",
        "--request-timeout",
        "9",
        "--max-tokens",
        "8",
    ]
    from poise.cli.lab_options import workload_from_args

    specs = []
    for argv in (["bench"], ["simulate"], ["sweep"], ["tune", "--slo-ttft-p95-ms", "100"]):
        args = build_parser().parse_args([*argv, *common])
        specs.append(workload_from_args(args))
    assert all(s == specs[0] for s in specs)
    spec = specs[0]
    assert spec.classes[0].name == "chat" and spec.seed == 7 and spec.timeout_s == 9
    assert [c.label for c in spec.cells()] == ["r5-cap2"]


def test_user_mix_replaces_the_base_and_bad_values_are_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from poise.cli.lab_options import workload_from_args

    base = WorkloadSpec(concurrency=(4,), long_ratio=(0.0, 0.5), long_repeat=27)
    args = build_parser().parse_args(["sweep", "--jsonl", "p.jsonl", "--request-rate", "3"])
    spec = workload_from_args(args, base)
    assert spec.jsonl == "p.jsonl" and spec.long_repeat == 27
    assert [c.label for c in spec.cells()] == ["r3"]  # no ratio cells, no cap from the base
    with pytest.raises(ValueError, match="--class"):
        workload_from_args(build_parser().parse_args(["sweep", "--class", "x:1"]))
    assert main(["bench", "--base-url", "http://h:1", "--long-ratio", "2"]) == 2
    assert "long_ratio" in capsys.readouterr().err


def test_simulate_takes_the_same_workload_and_refuses_what_it_cannot_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [
        "simulate",
        "--accelerator",
        "a10",
        "--model-shape",
        "SmolLM2-135M-Instruct",
        "--request-rate",
        "40",
        "--num-requests",
        "12",
        "--warmup",
        "0",
        "--max-tokens",
        "16",
        "--class",
        "a:1:100:16",
    ]
    out = tmp_path / "ok.yaml"
    assert main([*base, "--slo-ttft-p95-ms", "1000,a=0.001", "-o", str(out)]) == 0
    ov = yaml.safe_load(out.read_text())["results"][0]["metrics"]["overall"]
    assert ov["num_ok"] == 12 and ov["goodput"]["slo_attainment"] == 0.0  # the class target
    # A timeout below every request's end: each is recorded timed out, as a client sees it.
    late = tmp_path / "late.yaml"
    assert main([*base, "--request-timeout", "0.01", "-o", str(late)]) == 0
    ov = yaml.safe_load(late.read_text())["results"][0]["metrics"]["overall"]
    assert ov["num_ok"] == 0 and ov["num_timeouts"] == 12
    capsys.readouterr()
    assert main([*base, "--temperature", "0.7"]) == 2
    assert "need a live server" in capsys.readouterr().err
    tune = [
        *SIM_H100_TUNE,
        "--slo-ttft-p95-ms",
        "500",
        "--no-ignore-eos",
        "--out",
        str(tmp_path / "t"),
    ]
    assert main(tune) == 2
    assert "need a live server" in capsys.readouterr().err
