"""Calibration estimators recover known values from stored bench records and step traces
(tests/sim/records, written by make_records.py there: its docstring lists the true values)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from poise.lab.calibration import calibrate_from_records, calibrated_models, calibration_cells
from poise.sim.arrival import ArrivalModel
from poise.sim.calibrate import (
    RequestTiming,
    bracket,
    coefficient_of_variation,
    pool,
    predicted_tpot,
    request_overhead,
    time_per_token,
    tpot_time_scale,
    way_in_per_token,
)
from poise.sim.cost import FixedCostModel, LinearCostModel

RECORDS = Path(__file__).resolve().parent / "records"
R0, R1 = RECORDS / "round0.yaml", RECORDS / "round1.yaml"
MODEL = FixedCostModel(step_s=0.010)  # the fixtures' profile: 10 ms for every step


def test_only_measured_c1_requests_are_read() -> None:
    (c0,) = calibration_cells(R0)  # the c=4 cell is not a calibration cell
    assert len(c0.requests) == 4  # the warm-up is not counted
    assert c0.steps is not None and len(c0.steps) == 10  # its span of the linked trace
    (c1,) = calibration_cells(R1)
    assert c1.steps is None  # no trace linked


def test_request_overhead_and_way_in_from_header_latencies() -> None:
    cal = calibrate_from_records([R0, R1], MODEL)
    # 15 ms + 50 us x (20, 40, 60, 80) tokens: 16, 17, 18, 19 ms; the upper median.
    assert cal.request_overhead_s == pytest.approx(0.018)
    assert cal.way_in_s_per_token == pytest.approx(50e-6)
    lat = [0.016, 0.017, 0.018, 0.019]
    assert cal.request_overhead_cv == pytest.approx(coefficient_of_variation(lat))


def test_time_scale_and_jitter_from_the_step_trace_and_from_tpot() -> None:
    trace_cal = calibrate_from_records([R0], MODEL)
    (cell,) = trace_cal.cells
    assert cell.source == "step-trace"
    assert cell.time_scale == pytest.approx(1.2)
    assert cell.step_jitter_cv == pytest.approx(0.1)
    client_cal = calibrate_from_records([R1], MODEL)
    (cell,) = client_cal.cells
    assert cell.source == "tpot"
    assert cell.time_scale == pytest.approx(1.3)
    assert cell.step_jitter_cv == pytest.approx(1 / 13)
    both = calibrate_from_records([R0, R1], MODEL)
    assert both.time_scale == pytest.approx(1.25)  # pooled: the mean over cells
    assert both.step_jitter_cv == pytest.approx((0.1 + 1 / 13) / 2)


def test_tpot_scale_uses_the_models_decode_steps() -> None:
    # 1 ms per KV token read: a 10-token prompt with 3 outputs decodes at contexts 11 and 12.
    model = LinearCostModel(coefficients={"decode_ctx": 0.001})
    assert predicted_tpot(model, 10, 3) == pytest.approx(0.0115)
    reqs = [RequestTiming(0.01, 0.023, prompt_tokens=10, output_tokens=3)]
    assert tpot_time_scale(model, reqs) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="TPOT"):
        tpot_time_scale(model, [RequestTiming(0.01, None)])


def test_apply_keeps_user_terms_and_the_queue_order() -> None:
    cal = calibrate_from_records([R0, R1], MODEL)
    cost, arrival = cal.apply(MODEL, ArrivalModel())
    assert cost.time_scale == pytest.approx(1.25)
    assert arrival.request_overhead_s == pytest.approx(0.018)
    assert arrival.request_overhead_cv == pytest.approx(cal.request_overhead_cv)
    assert arrival.way_in_s_per_token == pytest.approx(50e-6)
    # With a way-in queue the order is the queue's: no spread. A term the user set stays.
    queued = ArrivalModel(way_in_workers=1, way_in_s_per_token=1e-5)
    cost, arrival = cal.apply(MODEL, queued, keep=["way_in_s_per_token", "time_scale"])
    assert arrival.request_overhead_cv == 0 and arrival.way_in_s_per_token == 1e-5
    assert cost.time_scale == 1.0 and cost.step_jitter_cv == pytest.approx(cal.step_jitter_cv)
    user = FixedCostModel(step_s=0.010, time_scale=2.0)
    cost, arrival, _ = calibrated_models([R0], user, ArrivalModel(way_in_workers=1))
    assert cost.time_scale == 2.0 and arrival.way_in_workers == 1


def test_estimator_edges() -> None:
    assert request_overhead([0.3, 0.1, 0.2]) == 0.2
    with pytest.raises(ValueError, match="header"):
        request_overhead([])
    assert way_in_per_token([0.01, 0.02], [30, 30]) is None  # one prompt length: not separable
    assert way_in_per_token([0.01, 0.02], [30, 32]) is None  # salts a few tokens apart: noise
    assert way_in_per_token([0.02, 0.01], [10, 20]) == 0.0  # never negative
    assert coefficient_of_variation([5.0]) == 0.0
    assert pool([1.0, 2.0]) == 1.5
    # Round r ran between calibration cells r and r+1; the last without one after takes its own.
    assert bracket([1.0, 1.2, 1.4, 2.0], 3) == pytest.approx([1.1, 1.3, 1.7])
    assert bracket([1.0, 1.2], 2) == pytest.approx([1.1, 1.2])
    with pytest.raises(ValueError, match="2 calibration cells for 3 rounds"):
        bracket([1.0, 2.0], 3)
    assert time_per_token([lambda: 100, lambda: 50], repeats=3) >= 0.0
    with pytest.raises(ValueError, match="no tokens"):
        time_per_token([lambda: 0], repeats=1)


def test_records_without_a_c1_cell_or_unreadable_are_refused(tmp_path: Path) -> None:
    d = yaml.safe_load(R0.read_text())
    d["results"] = d["results"][1:]  # the c=4 cell only
    d["artifacts"] = {}
    only_c4 = tmp_path / "c4.yaml"
    only_c4.write_text(yaml.safe_dump(d))
    with pytest.raises(ValueError, match="no closed-loop concurrency-1 cell"):
        calibrate_from_records([only_c4], MODEL)
    with pytest.raises(ValueError, match="cannot read the bench record"):
        calibrate_from_records([tmp_path / "missing.yaml"], MODEL)


def test_simulate_cli_calibrates_from_records(tmp_path: Path) -> None:
    from poise.cli import main

    for f in RECORDS.iterdir():  # records name their JSONL and trace relative to their folder
        if f.suffix in (".yaml", ".jsonl", ".json"):
            shutil.copy(f, tmp_path / f.name)
    out = tmp_path / "sim.yaml"
    rc = main(
        [
            "simulate",
            "--profile",
            str(tmp_path / "profile.json"),
            "--calibrate-from",
            str(tmp_path / "round0.yaml"),
            str(tmp_path / "round1.yaml"),
            "--way-in-workers",
            "1",
            "--concurrency",
            "2",
            "--num-requests",
            "4",
            "--max-tokens",
            "4",
            "--class",
            "c:1:20:4",
            "--num-kv-blocks",
            "64",
            "-o",
            str(out),
        ]
    )
    assert rc == 0
    prov = yaml.safe_load(out.read_text())["provenance"]
    assert prov["calibration"]["time_scale"] == pytest.approx(1.25)
    assert prov["cost_model"]["time_scale"] == pytest.approx(1.25)
    arrival = prov["arrival_model"]
    assert arrival["request_overhead_s"] == pytest.approx(0.018)
    assert arrival["way_in_s_per_token"] == round(50e-6, 4)  # records keep 4 decimals
    assert arrival["way_in_workers"] == 1 and arrival["request_overhead_cv"] == 0
    rc = main(
        [
            "simulate",
            "--profile",
            str(tmp_path / "profile.json"),
            "--calibrate-from",
            str(tmp_path / "nope.yaml"),
            "-o",
            str(tmp_path / "x.yaml"),
        ]
    )
    assert rc == 2
