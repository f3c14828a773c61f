"""The tuner's SLO scheduling phase: policy slo with classes, their shares and the token-budget
controller, against a scripted engine where those knobs cut the TTFT tail at the same
throughput; plus the candidate's flags and the class spec round trip."""

from __future__ import annotations

import shlex

import pytest

from poise.config import EngineConfig
from poise.lab.cell_metrics import CellMetrics
from poise.lab.commands import poise_serve_command
from poise.lab.probe import Candidate, FunctionProbe
from poise.lab.tune import Tuner, TuneSettings
from poise.lab.tune_slo import with_share
from poise.sched.classes import load_classes, parse_inline, to_inline
from tests.lab.mock_engine import mock_metrics

BUDGETS = (512, 1024, 2048)
SEQS = (4, 8, 16)


def slo_engine(c: Candidate) -> CellMetrics:
    """fifo as the mock engine; policy slo with classes cuts TTFT p95 by 40 %, more so the
    larger the first class's share (best at 0.9); the controller costs 1 % throughput and
    cuts the tail further only at the tightest target."""
    m = mock_metrics(
        c.with_(
            scheduling_policy="fifo",
            traffic_classes=None,
            token_budget_controller=False,
            target_tpot_ms=None,
        )
    )
    if c.scheduling_policy != "slo" or c.traffic_classes is None:
        return m
    share = load_classes(c.traffic_classes).classes[0].share
    ttft = m.ttft_p95_ms * (0.6 - 0.2 * (share - 0.7))  # type: ignore[operator]
    thr = m.output_tokens_per_s
    if c.token_budget_controller:
        thr = thr * 0.99  # type: ignore[operator]
        ttft *= 0.8 if c.target_tpot_ms is not None and c.target_tpot_ms < 40 else 1.0
    return CellMetrics(
        ttft_p50_ms=ttft * 0.6,
        ttft_p95_ms=ttft,
        tpot_p50_ms=m.tpot_p50_ms,
        e2e_p95_ms=m.e2e_p95_ms,
        output_tokens_per_s=thr,
        kv_usage_peak=m.kv_usage_peak,
        preemptions=m.preemptions,
        num_requests=m.num_requests,
    )


def _tune(**kw: object) -> tuple:
    probe = FunctionProbe(slo_engine)
    settings = TuneSettings(1500, 60.0, budgets=BUDGETS, seqs=SEQS, max_probes=60, **kw)  # type: ignore[arg-type]
    return Tuner(probe, settings).run(), probe


def test_the_slo_phase_finds_the_lower_tail_at_the_same_throughput() -> None:
    result, probe = _tune()
    slo_probes = [c for c in probe.calls if c.scheduling_policy == "slo"]
    assert slo_probes, "policy slo never probed"
    shares = {load_classes(c.traffic_classes).classes[0].share for c in slo_probes}
    assert shares >= {0.5, 0.7, 0.9}
    targets = {c.target_tpot_ms for c in slo_probes if c.token_budget_controller}
    assert targets == {36.0, 48.0, 60.0}  # 0.6 / 0.8 / 1.0 x the 60 ms TPOT SLO
    lat = result.latency_first
    assert lat is not None and lat.candidate.scheduling_policy == "slo"
    assert lat.candidate.token_budget_controller and lat.candidate.target_tpot_ms == 36.0
    assert load_classes(lat.candidate.traffic_classes).classes[0].share == 0.9
    assert any("lower tail, same throughput: keep" in d for d in result.decisions)
    # The controller costs 1 %: the throughput-first answer is not worse than without it.
    assert result.throughput_first is not None
    assert len(probe.calls) == len(set(probe.calls))


def test_the_phase_can_be_turned_off() -> None:
    _, probe = _tune(slo_scheduling=False)
    assert all(c.scheduling_policy != "slo" for c in probe.calls)


def test_no_tpot_slo_no_controller_probes() -> None:
    probe = FunctionProbe(slo_engine)
    Tuner(probe, TuneSettings(1500, None, budgets=BUDGETS, seqs=SEQS, max_probes=60)).run()
    assert any(c.scheduling_policy == "slo" for c in probe.calls)
    assert not any(c.token_budget_controller for c in probe.calls)


def test_class_spec_round_trips_and_shares_move() -> None:
    classes = load_classes("default")
    assert parse_inline(to_inline(classes)) == classes
    moved = with_share(classes, 0.9)
    assert moved is not None
    assert [c.share for c in moved.classes] == pytest.approx([0.9, 0.1])
    assert [c.min_prompt_tokens for c in moved.classes] == [0, 1024]
    assert with_share(load_classes("none"), 0.5) is None


def test_slo_candidate_flags_reach_the_engine_and_the_command() -> None:
    spec = to_inline(load_classes("default"))
    c = Candidate(
        1024, 8, "slo", traffic_classes=spec, token_budget_controller=True, target_tpot_ms=48.0
    )
    args = c.to_args()
    cfg = EngineConfig.from_kwargs(**args)
    assert cfg.scheduler.scheduling_policy == "slo"
    assert cfg.scheduler.token_budget_controller and cfg.scheduler.target_tpot_ms == 48.0
    argv = shlex.split(poise_serve_command(None, args))
    assert argv[argv.index("--traffic-classes") + 1] == spec
    assert "--token-budget-controller" in argv
    plain = Candidate(1024, 8, "slo")
    assert c.key != plain.key and "/" not in c.key and " " not in c.key
    assert "controller 48 ms" in c.label and "classes" in c.label
