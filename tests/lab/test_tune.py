"""The tuner against a scripted engine whose metrics are known functions of the knobs: it must
find the brute-force best configs, say so when nothing meets the SLO, and explain each move."""

from __future__ import annotations

import pytest

from poise.lab.cell_metrics import CellMetrics
from poise.lab.commands import poise_serve_command
from poise.lab.probe import Candidate, FunctionProbe
from poise.lab.tune import Tuner, TuneSettings
from poise.lab.tune_report import format_result
from tests.lab.mock_engine import best_by_brute_force, mock_metrics

BUDGETS = (512, 1024, 2048, 4096, 8192)
SEQS = (4, 8, 16, 32, 64)


def tune(slo_ttft: float, slo_tpot: float | None = None, **kw: object) -> tuple:
    probe = FunctionProbe(mock_metrics)
    settings = TuneSettings(slo_ttft, slo_tpot, budgets=BUDGETS, seqs=SEQS, max_probes=40, **kw)  # type: ignore[arg-type]
    return Tuner(probe, settings).run(), probe


@pytest.mark.parametrize("slo", [500, 700, 900, 2000])
def test_finds_brute_force_best(slo: float) -> None:
    result, probe = tune(slo)
    want_thr, want_lat = best_by_brute_force(BUDGETS, SEQS, slo)
    assert result.throughput_first is not None and result.latency_first is not None
    assert result.throughput_first.candidate == want_thr
    assert result.latency_first.candidate == want_lat
    # Never the same config twice, and fewer probes than the grid (5 x 5 x 2).
    assert len(probe.calls) == len(set(probe.calls)) < 50


def test_tpot_slo_constrains_the_answer() -> None:
    result, _ = tune(2000, slo_tpot=60.0)
    want_thr, _ = best_by_brute_force(BUDGETS, SEQS, 2000, slo_tpot=60.0)
    assert result.throughput_first is not None
    assert result.throughput_first.candidate == want_thr
    m = result.throughput_first.metrics
    assert m is not None and m.tpot_p50_ms is not None and m.tpot_p50_ms <= 60.0


def test_no_config_meets_the_slo() -> None:
    result, _ = tune(300)
    assert best_by_brute_force(BUDGETS, SEQS, 300) == (None, None)
    assert not result.met and result.throughput_first is None and result.latency_first is None
    assert result.closest is not None
    text = format_result(result, lambda c: poise_serve_command(None, c.to_args()))
    assert "No config meets the SLO" in text
    assert "poise serve --max-num-batched-tokens" in text


def test_decisions_explain_back_off_on_slo_breach() -> None:
    result, _ = tune(900)
    # 4096 -> 8192 fits at seqs 32 (868 ms); at seqs 4 the first budget step is not closer.
    assert any(
        d.startswith("budget 4096 -> 8192: throughput +") and d.endswith("keep")
        for d in result.decisions
    )
    assert any("max_num_seqs 32 -> 64" in d and "no throughput gain" in d for d in result.decisions)
    result, _ = tune(700)
    assert any(
        "budget 2048 -> 4096" in d and "> SLO 700 ms: back off" in d for d in result.decisions
    )


def test_preempting_config_is_never_an_answer() -> None:
    # Without the KV rule seqs 64 would tie seqs 32; it preempts, so it must not be chosen.
    result, _ = tune(5000)
    for ev in (result.throughput_first, result.latency_first):
        assert ev is not None and ev.metrics is not None and not ev.metrics.preemptions


def test_failed_probe_is_evidence_not_a_crash() -> None:
    def flaky(c: Candidate) -> CellMetrics:
        if c.max_num_batched_tokens >= 2048:
            raise RuntimeError("server died")
        return mock_metrics(c)

    settings = TuneSettings(900, budgets=BUDGETS, seqs=SEQS, max_probes=40)
    result = Tuner(FunctionProbe(flaky), settings).run()
    errors = [e for e in result.evidence if e.error]
    assert errors and all("server died" in (e.error or "") for e in errors)
    assert result.throughput_first is not None
    assert result.throughput_first.candidate.max_num_batched_tokens <= 1024
    assert any("probe failed" in d for d in result.decisions)


def test_probe_budget_is_respected() -> None:
    settings = TuneSettings(2000, budgets=BUDGETS, seqs=SEQS, max_probes=5)
    probe = FunctionProbe(mock_metrics)
    result = Tuner(probe, settings).run()
    assert len(probe.calls) == 5
    assert any("probe budget (5) spent" in d for d in result.decisions)


def test_settings_validate_ladders() -> None:
    with pytest.raises(ValueError, match="budgets"):
        TuneSettings(100, budgets=(2048, 1024))
    with pytest.raises(ValueError, match="slo"):
        TuneSettings(0)
