"""Metric math against closed-form answers: chunks vs tokens, usage sources, windows, SLOs."""

from __future__ import annotations

import math

import pytest

from poise.bench.stats import (
    SLO,
    RequestRecord,
    apportion,
    cell_metrics,
    client_health,
    derive,
    percentile,
    summarize,
)


def stream(start: float, ttft: float, tpot: float, n: int, k: int, **kw: object) -> RequestRecord:
    """A request whose first event carries 1 token at ttft and every later event k tokens,
    k*tpot apart (speculative-decoding shape): TPOT is exactly tpot for any k."""
    assert (n - 1) % k == 0
    events = [start + ttft + j * k * tpot for j in range((n - 1) // k + 1)]
    ks = [1] + [k] * (len(events) - 1)
    return RequestRecord(
        0,
        "short",
        start,
        events=events,
        event_chars=[4 * x for x in ks],
        end=events[-1] + 0.001,
        usage_completion_tokens=n,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_tpot_and_itl_do_not_depend_on_tokens_per_chunk(k: int) -> None:
    st = derive(stream(10.0, 0.2, 0.01, 33, k))
    assert st.ttft == pytest.approx(0.2)
    assert st.tpot == pytest.approx(0.01)
    assert st.itl_source == "text"
    assert len(st.itl) == 32 and all(x == pytest.approx(0.01) for x in st.itl)
    assert all(x == pytest.approx(0.01 * k) for x in st.icl)  # raw chunk gaps do scale
    assert st.max_stall == pytest.approx(0.01 * k)


def test_per_event_usage_wins_over_text_estimate() -> None:
    rec = stream(0.0, 0.1, 0.02, 9, 4)
    rec.event_tokens = [1, 4, 4]
    rec.event_chars = [1, 1, 100]  # would mislead the text estimate
    st = derive(rec)
    assert st.itl_source == "event_usage"
    assert st.itl == pytest.approx([0.02] * 8)


def test_without_usage_counts_events_and_says_so() -> None:
    rec = stream(0.0, 0.1, 0.02, 9, 4)
    rec.usage_completion_tokens = None
    st = derive(rec)
    assert (st.n_out, st.n_out_source, st.itl_source) == (3, "events", "one_per_event")
    assert st.tpot == pytest.approx(0.16 / 2)


def test_apportion() -> None:
    assert apportion(10, [1, 1, 1, 1, 1]) == [2, 2, 2, 2, 2]
    assert sum(apportion(7, [3, 1, 1])) == 7
    assert apportion(33, [4] + [16] * 8) == [1] + [4] * 8
    assert sum(apportion(2, [1, 1, 1])) == 2
    assert apportion(4, [100, 1, 1]) == [2, 1, 1]


def test_percentile_and_inf() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([], 50) is None
    assert percentile([1.0, math.inf], 99) == math.inf
    assert percentile([1.0, 2.0, math.inf], 50) == 2.0
    s = summarize([0.001, 0.002, None])
    assert s["n"] == 2 and s["p50"] == pytest.approx(1.5)


def test_cell_window_warmup_and_classes() -> None:
    recs = [stream(0.0, 0.5, 0.01, 5, 1, warmup=True)]
    recs += [stream(1.0 + i, 0.1, 0.01, 5, 1, max_tokens=5) for i in range(4)]
    recs[-1].class_name = "long"
    m = cell_metrics(recs)
    ov = m["overall"]
    assert ov["num_requests"] == 4
    w0, w1 = m["window"]
    assert w0 == 1.0 and w1 == pytest.approx(4.0 + 0.1 + 0.04 + 0.001)
    assert ov["output_tokens_per_s"] == pytest.approx(20 / (w1 - w0))
    assert ov["ttft_ms"]["p50"] == pytest.approx(100.0)  # the warmup's 500 ms is excluded
    assert set(m["classes"]) == {"short", "long"}
    assert m["classes"]["long"]["num_requests"] == 1
    assert ov["shortfall"]["num_short"] == 0


def test_failures_goodput_and_error_aware_tails() -> None:
    recs = [stream(float(i), 0.1 * (i + 1), 0.01, 5, 1) for i in range(4)]  # ttft 100..400 ms
    recs.append(RequestRecord(9, "short", 4.0, end=5.0, ok=False, error="timeout", timed_out=True))
    slo = SLO(ttft_ms=250, tpot_ms=20)
    m = cell_metrics(recs, slo)["overall"]
    assert (m["num_ok"], m["num_timeouts"], m["num_errors"]) == (4, 1, 0)
    assert m["goodput"]["num_good"] == 2
    assert m["goodput"]["slo_attainment"] == pytest.approx(2 / 5)
    assert m["ttft_ms"]["max"] == pytest.approx(400)
    tails = cell_metrics(recs, slo, include_failures=True)["overall"]
    assert tails["ttft_ms"]["max"] == math.inf and tails["ttft_ms"]["n"] == 5


def test_shortfall_reported() -> None:
    rec = stream(0.0, 0.1, 0.01, 5, 1, max_tokens=8)
    m = cell_metrics([rec])["overall"]
    assert m["shortfall"]["num_short"] == 1


def test_sched_lag_and_validity() -> None:
    recs = [stream(1.0 + i * 0.1, 0.1, 0.01, 5, 1, intended=1.0 + i * 0.1 - 0.05) for i in range(5)]
    m = cell_metrics(recs)["overall"]
    assert m["sched_lag_ms"]["p50"] == pytest.approx(50)
    assert m["ttft_sched_ms"]["p50"] == pytest.approx(150)
    h = client_health(recs, loop_lags=[0.001] * 10, max_lag_ms=10)
    assert not h["valid"] and "sched_lag" in h["invalid_reasons"][0]
    ok = client_health(recs, loop_lags=[0.001] * 10, max_lag_ms=100)
    assert ok["valid"]
    busy = client_health(recs, loop_lags=[0.05] * 10, max_lag_ms=10, cpu_util=0.97)
    assert "client saturated" in busy["invalid_reasons"][-1]
    host = client_health(recs, loop_lags=[0.05] * 10, max_lag_ms=10, cpu_util=0.05)
    assert "host CPU contention" in host["invalid_reasons"][-1]


def test_from_token_times_roundtrip() -> None:
    rec = RequestRecord.from_token_times(3, "long", 0.0, [0.5, 0.6, 0.7], max_tokens=3)
    assert RequestRecord.from_dict(rec.to_dict()) == rec
    st = derive(rec)
    assert st.ttft == 0.5 and st.tpot == pytest.approx(0.1) and st.itl_source == "event_usage"


def test_per_class_slo_overrides() -> None:
    short = stream(0.0, 0.3, 0.01, 5, 1)  # ttft 300 ms
    long = stream(0.0, 2.0, 0.01, 5, 1)
    long.class_name = "long"
    strict = SLO(ttft_ms=500)
    relaxed = SLO(ttft_ms=500, per_class={"long": (3000.0, None)})
    assert cell_metrics([short, long], strict)["overall"]["goodput"]["num_good"] == 1
    out = cell_metrics([short, long], relaxed)
    assert out["overall"]["goodput"]["num_good"] == 2
    assert out["classes"]["long"]["goodput"]["slo_attainment"] == 1.0
    assert SLO(per_class={"long": (None, 50.0)}).active and not SLO().active
