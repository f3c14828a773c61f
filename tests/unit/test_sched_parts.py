"""The policy layer's pure parts: class specs, share ledger, step-cost estimator, forecasts."""

from __future__ import annotations

from pathlib import Path

import pytest

from poise.errors import InvalidRequestError
from poise.sched.classes import NO_CLASSES, load_classes, parse_inline
from poise.sched.estimator import StepCostEstimator
from poise.sched.predictor import Backlog, forecast, refusal
from poise.sched.shares import ShareLedger

SPEC = (
    "interactive:ttft_p95_ms=800,tpot_p50_ms=150,share=0.7;"
    "long:prompt_tokens>=1024,ttft_p95_ms=10000,share=0.3"
)


def test_inline_spec_assigns_by_rule_and_by_name() -> None:
    cs = parse_inline(SPEC)
    assert cs.names == ["interactive", "long"]
    assert cs.assign(100).name == "interactive"
    assert cs.assign(1024).name == "long"
    assert cs.assign(5000, requested="interactive").name == "interactive"
    t = cs.targets(2000)
    assert (t.class_name, t.ttft_s, t.tpot_s) == ("long", 10.0, None)
    t = cs.targets(10, ttft_ms=300)  # a per-request override wins over the class
    assert (t.class_name, t.ttft_s, t.tpot_s) == ("interactive", 0.3, 0.15)
    with pytest.raises(InvalidRequestError, match="unknown traffic class 'batch'"):
        cs.assign(10, requested="batch")


def test_yaml_default_and_none(tmp_path: Path) -> None:
    path = tmp_path / "classes.yaml"
    path.write_text(
        "classes:\n  chat: {ttft_p95_ms: 500, share: 0.5}\n"
        "  docs: {min_prompt_tokens: 2048, ttft_p95_ms: 20000, share: 0.5}\n"
    )
    cs = load_classes(str(path))
    assert cs.assign(3000).name == "docs" and cs.assign(3).name == "chat"
    assert load_classes("none") is NO_CLASSES and not NO_CLASSES.has_shares
    default = load_classes("default")
    assert default.has_shares and default.assign(2000).name == "long"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("a:share=0.8;b:share=0.5", "add up to 1.3"),
        ("a:colour=red", "unknown key"),
        ("a:ttft_p95_ms=-1", "must be > 0"),
        ("a:share=x", "share must be a number"),
        ("a:share", "'share' in class 'a' is not key=value"),
        ("a b:share=0.1", "bad class name"),
        ("a:share=0.1;a:share=0.1", "duplicate"),
    ],
)
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_inline(spec)


def test_share_ledger_protects_reservations_only_while_wanted() -> None:
    shares = {"short": 0.7, "long": 0.3}
    # Both classes want much more than the budget: long gets only what short does not reserve.
    ledger = ShareLedger(shares, 100, 10, {}, {"short": 500, "long": 500}, {"short": 5, "long": 5})
    assert ledger.token_allowance("long", 100) == 30
    ledger.took_prefill("long", 30)
    assert ledger.token_allowance("short", 70) == 70
    # Work-conserving: short wants only 10 tokens, so long may take the other 90.
    ledger = ShareLedger(shares, 100, 10, {}, {"short": 10, "long": 500}, {"short": 1, "long": 5})
    assert ledger.token_allowance("long", 100) == 90
    # Nothing of short waiting: long takes every token and every slot.
    ledger = ShareLedger(shares, 100, 10, {}, {"long": 500}, {"long": 9})
    assert ledger.token_allowance("long", 100) == 100
    assert ledger.slot_allowed("long", 1)
    # Short waiting and under its 7 slots: long may not take the last free ones.
    ledger = ShareLedger(shares, 100, 10, {"long": 6}, {}, {"short": 2, "long": 3})
    assert not ledger.slot_allowed("long", 2)
    assert ledger.slot_allowed("long", 3)
    assert ledger.slot_allowed("short", 1)


def test_estimator_learns_a_linear_step_cost() -> None:
    est = StepCostEstimator()  # default prior, far from the truth below
    a, b = 0.05, 0.002
    for i in range(400):
        n = 1 + (i * 37) % 300
        est.observe(n, a + b * n)
    assert est.const_s == pytest.approx(a, rel=0.05)
    assert est.per_token_s == pytest.approx(b, rel=0.05)
    assert est.tokens_for(a + b * 100) == pytest.approx(100, rel=0.05)


def test_estimator_keeps_the_prior_slope_when_sizes_do_not_vary() -> None:
    est = StepCostEstimator(const_s=0.01, per_token_s=0.001)
    for _ in range(2000):
        est.observe(64, 0.2)
    assert est.step_time(64) == pytest.approx(0.2, rel=0.05)
    assert est.per_token_s > 0


def test_forecast_replays_decodes_slots_and_classes() -> None:
    est = StepCostEstimator(const_s=0.1, per_token_s=0.001)

    def backlog(**kw: object) -> Backlog:
        base: dict[str, object] = dict(
            budget=100,
            max_num_seqs=64,
            share=1.0,
            decodes=[],
            ahead=[],
            own_tokens=50,
            other_prefill=0,
        )
        base.update(kw)
        return Backlog(**base)  # type: ignore[arg-type]

    # 350 tokens ahead + 50 own at 100 per step: 4 steps of 0.2 s.
    b = backlog(ahead=[(350, 1, False)])
    assert forecast(est, b).ttft_s == pytest.approx(0.8)
    # 20 decodes leave 80 prefill tokens per step: 5 steps of 0.2 s.
    assert forecast(est, backlog(ahead=[(350, 1, False)], decodes=[99] * 20)).ttft_s == (
        pytest.approx(1.0)
    )
    # A class with a 0.25 share while others have work: 25 tokens per step, 2 steps of 0.2 s.
    assert forecast(est, backlog(share=0.25, other_prefill=10_000)).ttft_s == pytest.approx(0.4)
    # No slot until one of the 8 running decodes (3 tokens left) finishes.
    slots = backlog(decodes=[3] * 8, own_tokens=10, max_num_seqs=8)
    assert forecast(est, slots).ttft_s == pytest.approx(3 * 0.108 + 0.11)
    # Refused with the first step boundary after which it would meet 0.4 s: after 2 steps
    # 150 + 50 tokens are left, 2 steps of 0.2 s.
    fc = forecast(est, b)
    assert refusal(est, b, fc, target_s=1.0, margin=0.0) is None
    assert refusal(est, b, fc, target_s=0.4, margin=0.5) == pytest.approx(0.4)


def test_cost_aware_victim_and_thrash_guard() -> None:
    from poise.core.request import Request, SloTargets
    from poise.core.sampling_params import SamplingParams
    from poise.sched.estimator import StepCostEstimator
    from poise.sched.ordering import victim_cost_aware
    from poise.sched.view import PolicyParams, PolicyView

    def req(rid: str, prio: int, computed: int, preempted: int = 0, ttft: float = 1.0) -> Request:
        r = Request(
            rid,
            list(range(100)),
            SamplingParams(),
            0.0,
            priority=prio,
            slo=SloTargets("c", ttft_s=ttft),
        )
        r.num_computed_tokens, r.num_preemptions = computed, preempted
        return r

    # A prompt token costs 1 ms, a step of the 50-token budget 50 ms.
    cost = StepCostEstimator(const_s=0.0, per_token_s=0.001)
    ctx = PolicyView(0.0, PolicyParams(preemption_thrash_limit=2), budget=50, cost=cost)
    current = req("cur", 0, 10)
    # Lowest priority first (largest value), whatever the work lost.
    low, high = req("low", 3, 90), req("high", 0, 5)
    assert victim_cost_aware([high, low], current, ctx) is low
    # Same priority: the one with more slack (a later deadline), then the least work lost.
    tight, lax = req("tight", 1, 20, ttft=0.5), req("lax", 1, 20, ttft=5.0)
    assert victim_cost_aware([lax, tight], current, ctx) is lax
    small, big = req("small", 1, 10, ttft=5.0), req("big", 1, 80, ttft=5.0)
    assert victim_cost_aware([big, small], current, ctx) is small
    # The thrash guard: twice preempted is spared while another candidate exists.
    worn = req("worn", 3, 10, preempted=2)
    assert victim_cost_aware([worn, high], current, ctx) is high
    assert victim_cost_aware([worn], req("cur2", 0, 10, preempted=5), ctx) is worn
