"""benchmarks/gpu_check.py --dry-run: the GPU check's whole script on the CPU, tiny shapes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_dry_run_writes_the_gpu_records_fields(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "record.yaml"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--steps", "2"]) == 0
    record = yaml.safe_load(out.read_text())
    assert tuple(record) == gpu_check.RECORD_FIELDS
    assert record["dry_run"] is True and record["attention_backend"] == "flex"
    assert record["equality"]["match"] is True
    assert [row["batch"] for row in record["decode"]] == [1, 8, 32]
    assert all(row["step_ms"] > 0 and row["weight_read_floor_ms"] > 0 for row in record["decode"])
    assert record["copy_gb_per_s"] > 0
