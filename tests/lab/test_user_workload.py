"""`poise sweep` and `poise tune` run the user's traffic (--jsonl, --class, --request-rate), not
only the seed mix: the same workload flags as `poise bench`, against the scripted engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from poise.cli import main
from tests.lab.conftest import MOCK_TEMPLATE


def test_sweep_runs_a_jsonl_workload(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "summarise the queue", "class": "ask"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "a log"}], "class": "log"})
        + "\n"
    )
    config = tmp_path / "mock.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": "m",
                "command": MOCK_TEMPLATE,
                "startup_timeout_s": 30,
                "args": {"max_num_batched_tokens": 512, "max_num_seqs": 4},
            }
        )
    )
    out = tmp_path / "out"
    argv = [
        "sweep",
        str(config),
        "--jsonl",
        str(prompts),
        "--concurrency",
        "2",
        "--num-requests",
        "4",
        "--warmup",
        "1",
        "--max-tokens",
        "8",
        "--slo-ttft-p95-ms",
        "5000",
        "--no-plots",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    # No long-ratio axis with a prompts file: one cell per load, labelled by the load alone.
    stored = json.loads((out / "cells" / "m" / "c2.json").read_text())
    classes = {r["class_name"] for r in stored["records"]}
    assert classes == {"ask", "log"}
    report = (out / "report.md").read_text()
    assert "### c2 (concurrency 2)" in report and f"prompts from {prompts}" in report
    assert "Throughput-first within TTFT p95 <= 5.00 s: **m**" in report


def test_tune_runs_a_class_mix_in_open_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "tune",
        "--slo-ttft-p95-ms",
        "200",
        "--command-template",
        MOCK_TEMPLATE,
        "--budgets",
        "512,1024",
        "--seqs",
        "4",
        "--class",
        "chat:1:20:8",
        "--request-rate",
        "20",
        "--num-requests",
        "8",
        "--warmup",
        "1",
        "--no-latency-search",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    record = json.loads((tmp_path / "tune.json").read_text())
    assert record["workload"]["classes"][0]["name"] == "chat"
    assert record["workload"]["request_rate"] == [20.0]
    assert record["workload"]["concurrency"] == []  # open loop: no cap carried from the base
    assert len(record["evidence"]) == 2
    cells = sorted((tmp_path / "probes" / "cells").glob("*/*.json"))
    assert [p.name for p in cells] == ["r20.json", "r20.json"]
    first = json.loads(cells[0].read_text())
    assert {r["class_name"] for r in first["records"]} == {"chat"}
    assert first["result"]["load"]["mode"] == "open"
