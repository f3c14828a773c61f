"""benchmarks/gpu_check.py --dry-run: the GPU check's whole script on the CPU, tiny shapes
(three poise servers, ~30 s)."""

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
    # The lab: configs A / B / C at 8 / 16 / 32 clients, every request served.
    lab = record["lab"]
    assert {(r["config"][0], r["concurrency"]) for r in lab} == {
        (c, n) for c in "ABC" for n in (8, 16, 32)
    }
    assert all(r["requests_ok"] == 4 and r["output_tokens_per_s"] > 0 for r in lab)
    # The concurrency-1 record is one `poise simulate --calibrate-from` takes.
    from poise.lab.calibration import calibrated_models
    from poise.sim.arrival import ArrivalModel
    from poise.sim.roofline import RooflineCostModel

    calibration = record["calibration"]
    assert calibration["accelerator"] == "h200" and calibration["time_scale"] > 0
    model = RooflineCostModel.build(record["lab_model"], "h200")
    calibrated, _, _ = calibrated_models([tmp_path / calibration["record"]], model, ArrivalModel())
    assert calibrated.time_scale == calibration["time_scale"]
