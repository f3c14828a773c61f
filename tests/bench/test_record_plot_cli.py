"""Records from per-request data computed elsewhere (the simulator's path), YAML round trips,
plots (PNG + self-contained HTML) and the CLI end to end against the mock."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from poise.bench.plot import pareto_front, write_report
from poise.bench.prom import Scrape
from poise.bench.record import TEMPLATE_METRICS, ExperimentRecord, build_cell
from poise.bench.stats import RequestRecord


def simulated_record() -> ExperimentRecord:
    cells = []
    for conc in (2, 4):
        recs = []
        for i in range(8):
            start = 0.5 * (i // conc)
            ttft = 0.1 * conc + (0.3 if i % 4 == 3 else 0.0)
            toks = [start + ttft + 0.01 * j for j in range(5)]
            recs.append(
                RequestRecord.from_token_times(
                    i,
                    "long" if i % 4 == 3 else "short",
                    start,
                    toks,
                    max_tokens=5,
                    intended=start,
                )
            )
        scrapes = [Scrape(t * 0.5, 0.1 * conc, conc, 1, 2 * t) for t in range(6)]
        load = {
            "label": f"c{conc}-long0.25",
            "mode": "closed",
            "concurrency": conc,
            "long_prompt_ratio": 0.25,
        }
        cells.append(build_cell(load, recs, scrapes=scrapes, loop_lags=[0.0]))
    exp = {
        "model": "m",
        "gpu": "virtual",
        "engine": "poise-sim",
        "version": "0",
        "workload": {"concurrency": [2, 4], "long_prompt_ratio": [0.25], "max_tokens": 5},
        "server_args": {"max_num_seqs": 4},
    }
    return ExperimentRecord(exp, cells, provenance={"tool_version": "t"}, kind="simulated")


def test_record_from_simulated_requests_has_template_fields(tmp_path: Path) -> None:
    rec = simulated_record()
    d = yaml.safe_load(rec.to_yaml())
    assert d["kind"] == "simulated"
    exp = d["experiment"]
    for key in ("model", "gpu", "engine", "version", "workload", "server_args", "metrics"):
        assert key in exp
    for m in exp["metrics"]:
        assert set(TEMPLATE_METRICS) <= set(m)
    m2 = exp["metrics"][0]
    assert m2["p50_ttft_ms"] == pytest.approx(200.0)
    assert m2["p50_tpot_ms"] == pytest.approx(10.0)
    assert m2["preemption_count"] == 10  # counter 0 -> 10 across the window's edges
    assert d["results"][0]["metrics"]["classes"]["long"]["ttft_ms"]["p50"] == pytest.approx(500.0)
    compat = d["results"][0]["compat_vllm"]
    assert compat["completed"] == 8 and compat["median_tpot_ms"] == pytest.approx(10.0)
    assert compat["output_throughput"] == pytest.approx(m2["output_tokens_per_s"])
    back = ExperimentRecord.load(rec.save(tmp_path / "sim.yaml"))
    assert back.kind == "simulated" and len(back.cells[1].records) == 8
    assert back.to_dict()["experiment"]["metrics"] == exp["metrics"]


def test_pareto_front() -> None:
    pts = [(100, 50), (200, 80), (150, 90), (300, 200), (250, 300)]
    assert pareto_front(pts) == [(100, 50), (200, 80), (300, 200)]


def test_plots_write_png_and_self_contained_html(tmp_path: Path) -> None:
    rec = simulated_record()
    files = write_report([("sim", rec), ("sim2", rec)], tmp_path / "out", slo_ttft_ms=400)
    for key in ("ttft_vs_throughput", "cdf", "timeline"):
        assert files[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = files["html"].read_text()
    assert html.count("data:image/png;base64,") == 3 and 'src="http' not in html
    b64 = html.split("data:image/png;base64,")[1].split('"')[0]
    assert base64.b64decode(b64)[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        write_report([("sim", rec)], tmp_path / "x", cell_label="nope")


def test_cli_bench_and_plot(mock: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from poise.cli import main

    srv = mock(ttft=0.02, tpot=0.002, k=4, role_chunk=True)
    out = tmp_path / "run.yaml"
    rc = main(
        [
            "bench",
            "--base-url",
            srv.base_url,
            "--concurrency",
            "2,4",
            "--long-ratio",
            "0,0.5",
            "--max-tokens",
            "17",
            "--num-requests",
            "4",
            "--warmup",
            "1",
            "--scrape-interval",
            "0.2",
            "--slo-ttft-p95-ms",
            "500,long=5000",
            "--server-arg",
            "max_num_seqs=64",
            "--gpu",
            "cpu",
            "--no-progress",
            "-o",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "c4-long0.5" in text and "TTFT p95" in text
    d = yaml.safe_load(out.read_text())
    assert d["experiment"]["server_args"] == {"max_num_seqs": 64}
    assert d["experiment"]["workload"]["concurrency"] == [2, 4]
    assert d["provenance"]["command"].startswith("poise")
    assert len(d["experiment"]["metrics"]) == 4
    assert d["experiment"]["workload"]["class_slo_ttft_ms"] == {"long": 5000.0}
    goodput = d["results"][1]["metrics"]["overall"]["goodput"]
    assert goodput["slo_ttft_ms"] == 500 and goodput["slo_per_class"] == {"long": [5000.0, None]}
    rc = main(["bench", "plot", str(out), "--out", str(tmp_path / "plots")])
    assert rc == 0 and (tmp_path / "plots" / "report.html").exists()
    assert main(["bench", "--concurrency", "2"]) == 2  # no --base-url
