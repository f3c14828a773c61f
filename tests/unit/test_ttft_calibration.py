"""sched/calibration.py: admission multiplies its TTFT forecast by how late first tokens came."""

from __future__ import annotations

from poise.sched.calibration import MIN_SAMPLES, WINDOW_S, TtftCalibration
from poise.sched.estimator import StepCostEstimator
from poise.sched.predictor import Backlog, forecast, refusal


def test_the_factor_is_the_recent_95th_percentile_of_lateness_and_never_below_one() -> None:
    cal = TtftCalibration()
    assert cal.factor(0.0) == 1.0
    for i in range(100):  # 95 on time, 5 three times late
        cal.observe(0.1, 0.3 if i % 20 == 0 else 0.1, now=1.0 + i * 0.01, floor_s=0.01)
    assert abs(cal.factor(2.0) - 3.0) < 1e-9  # the 95th of 100 sorted: a late one
    early = TtftCalibration()
    for _ in range(50):
        early.observe(0.2, 0.1, now=1.0, floor_s=0.01)  # forecasts that err late: not loosened
    assert early.factor(1.0) == 1.0


def test_old_samples_stop_counting_and_a_near_zero_forecast_is_floored() -> None:
    cal = TtftCalibration()
    for _ in range(MIN_SAMPLES):
        cal.observe(0.0, 0.05, now=0.0, floor_s=0.025)  # ratio 0.05 / 0.025, not / 0
    assert abs(cal.factor(1.0) - 2.0) < 1e-9
    assert cal.factor(WINDOW_S + 0.5) == 1.0  # the slow spell is forgotten


def test_admission_refuses_what_the_factor_pushes_past_the_target() -> None:
    est = StepCostEstimator(0.01, 0.0)
    backlog = Backlog(budget=512, max_num_seqs=8, share=1.0, decodes=[5] * 8, ahead=[],
                      own_tokens=3, other_prefill=0)  # fmt: skip
    fc = forecast(est, backlog)  # a slot frees after 5 steps: ~60 ms
    assert 0.04 < fc.ttft_s < 0.08
    assert refusal(est, backlog, fc, target_s=0.1, margin=0.0) is None
    wait = refusal(est, backlog, fc, target_s=0.1, margin=0.0, factor=3.0)
    assert wait is not None and wait > 0
