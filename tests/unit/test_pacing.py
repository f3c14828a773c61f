"""The slo policy's pacing (sched/pacing.py) on a synthetic step cost a + b x tokens."""

from __future__ import annotations

import random

import pytest

from poise.core.request import Request, SloTargets
from poise.core.timing import percentile
from poise.sched import pacing, scheduler
from poise.sched.classes import load_classes
from poise.sched.estimator import StepCostEstimator
from poise.sched.pacing import LIFT_STEP, deadline_missed, lift_cap, pacing_for
from poise.sched.reserve import PromptReserve
from poise.sched.view import PolicyParams, PolicyView
from tests.unit.test_policies import toks
from tests.unit.timed import Arrival, drive, make_engine, params

SPEC = "short:ttft_p95_ms=1000,share=0.7;long:prompt_tokens>=1024,ttft_p95_ms={long},share=0.3"


def open_loop(seconds: float) -> list[Arrival]:
    """Short prompts (Poisson, ~2.5/s) among long ones every 4 s, beside 4 decodes."""
    rng = random.Random(0)
    arrivals = [Arrival(0.0, f"d{i}", toks(8, i), params(int(seconds * 10))) for i in range(4)]
    t, i = 0.0, 0
    while t < seconds:
        t += rng.expovariate(2.5)
        arrivals.append(Arrival(t, f"s{i}", toks(100, 100 + i), params(8)))
        i += 1
    longs = int(seconds / 4)
    arrivals += [
        Arrival(4.0 * k + 0.5, f"l{k}", toks(3000, 900 + k), params(8)) for k in range(longs)
    ]
    return arrivals


def run(
    monkeypatch: pytest.MonkeyPatch,
    paced: bool,
    long_ms: int,
    a: float = 0.02,
    seconds: float = 40.0,
) -> dict[str, float]:
    monkeypatch.undo()
    if not paced:
        monkeypatch.setattr(scheduler, "pacing_for", lambda *args: None)
    engine, _, clock = make_engine(
        a=a,
        b=0.0005,
        num_kv_blocks=8192,
        scheduling_policy="slo",
        traffic_classes=SPEC.format(long=long_ms),
        max_num_batched_tokens=2048,
    )
    out = drive(engine, open_loop(seconds))
    ttft = {k: v.metrics.ttft for k, v in out.items()}
    assert all(v is not None for v in ttft.values())
    assert engine.scheduler.kv_cache_usage == 0.0
    return {
        "short": percentile([v for k, v in ttft.items() if k[0] == "s"], 95),  # type: ignore[misc]
        "long": percentile([v for k, v in ttft.items() if k[0] == "l"], 95),  # type: ignore[misc]
        # When the last short or long request finished: the same work, paced or not.
        "end": max(v.times.finished for k, v in out.items() if k[0] != "d"),  # type: ignore[union-attr,type-var]
    }


def test_pacing_holds_short_ttft_when_steps_are_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2,048-token step lasts ~1 s here: unpaced, a short prompt arriving during a long one's
    chunk waits for it; paced, steps stay near 150 ms and the short ones meet 1 s."""
    plain = run(monkeypatch, paced=False, long_ms=15000)
    paced = run(monkeypatch, paced=True, long_ms=15000)
    assert plain["short"] > 1.0  # the chunk in progress holds them past their target
    assert paced["short"] < 0.6 and paced["short"] < plain["short"] / 2
    assert paced["long"] < 15.0  # slowed, within its own target
    assert paced["end"] < plain["end"] * 1.05  # the same work in about the same time


def test_pacing_gives_way_to_a_long_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a costly step (a = 0.2 s) a paced step of ~0.35 s carries 300 prefill tokens: a
    3,000-token prompt would take ~4 s, so against a 2.5 s target the cap is lifted for it."""
    lifted = run(monkeypatch, paced=True, long_ms=2500, a=0.2, seconds=8.0)
    monkeypatch.setattr(pacing, "lift_cap", lambda paced, cap, *args: cap)  # never lifts
    engine, _, _ = make_engine(
        a=0.2,
        b=0.0005,
        num_kv_blocks=8192,
        scheduling_policy="slo",
        traffic_classes=SPEC.format(long=2500),
        max_num_batched_tokens=2048,
    )
    out = drive(engine, open_loop(8.0))
    never = percentile([v.metrics.ttft for k, v in out.items() if k[0] == "l"], 95)  # type: ignore[misc]
    assert never > 2.5 * 1.5
    assert lifted["long"] < 2.5 * 1.1


def test_pacing_only_where_targets_differ() -> None:
    assert pacing_for(load_classes("none"), 64) is None
    assert pacing_for(load_classes("a:ttft_p95_ms=500;b:ttft_p95_ms=500"), 64) is None
    pacing = pacing_for(load_classes(SPEC.format(long=15000)), 64)
    assert pacing is not None and pacing.paced == {"long"} and pacing.prefill_s == 0.15
    fast = StepCostEstimator(const_s=0.005, per_token_s=1e-5)  # an accelerator: no cap
    assert pacing.caps(fast, num_decodes=32, budget=2048) == {}
    # 150 ms of prefill beside the decodes, however long the decodes take.
    slow = StepCostEstimator(const_s=0.3, per_token_s=5e-4)
    assert pacing.caps(slow, num_decodes=32, budget=2048) == {"long": 300}
    crawl = StepCostEstimator(const_s=0.02, per_token_s=5e-3)  # 30 tokens: the floor holds
    assert pacing.caps(crawl, num_decodes=32, budget=2048) == {"long": 64}


def test_the_engine_reports_its_pacing() -> None:
    """The gauge's source: a paced class's cap while it holds, the whole budget when lifted."""
    engine, _, _ = make_engine(
        a=0.02,
        b=0.0005,
        num_kv_blocks=8192,
        scheduling_policy="slo",
        traffic_classes=SPEC.format(long=15000),
        max_num_batched_tokens=2048,
    )
    seen = []
    for i, (rid, n) in enumerate([("d", 8), ("l", 3000)]):
        engine.add_request(rid, toks(n, i), params(50))
    for _ in range(6):
        engine.step()
        seen.append(dict(engine.snapshot().paced_prefill_tokens))
    assert all(set(s) == {"long"} for s in seen)
    assert min(s["long"] for s in seen) < 2048  # capped while the long prompt is prefilled


def test_other_policies_are_not_paced() -> None:
    for policy in ("fifo", "priority", "prefill_first"):
        engine, _, _ = make_engine(
            scheduling_policy=policy, traffic_classes=SPEC.format(long=15000)
        )
        assert engine.scheduler.pacing is None


def test_a_lifted_cap_rises_only_as_far_as_the_deadline_needs() -> None:
    """A long prefill that misses its deadline at the paced rate gets the least cap on the
    x1.5 ladder that meets it, not the whole step; none when even the whole step is too slow."""
    cost = StepCostEstimator(const_s=0.05, per_token_s=5e-4)
    ctx = PolicyView(0.0, PolicyParams(), budget=100, cost=cost)  # deadlines: now, aging 0

    def long_prompt(target_s: float) -> Request:
        r = Request("l", toks(3000, 1), params(8), arrival_time=0.0)
        r.slo = SloTargets(class_name="long", ttft_s=target_s)
        return r

    # At 300 tokens a step (0.22 s) the prompt needs 10 steps, 2.2 s: a 2.5 s target holds.
    assert lift_cap([long_prompt(2.5)], 300, 32, 2048, cost, ctx) == 300
    lifted = lift_cap([long_prompt(1.8)], 300, 32, 2048, cost, ctx)
    assert lifted is not None and 300 < lifted < 2048 - 32
    r = long_prompt(1.8)
    step = lambda c: cost.step_time(32 + c)  # noqa: E731
    assert not deadline_missed([r], lifted, step(lifted), ctx)
    below = int((lifted - 1) / LIFT_STEP)  # the rung under it misses
    assert deadline_missed([r], below, step(below), ctx)
    assert lift_cap([long_prompt(0.5)], 300, 32, 2048, cost, ctx) is None


@pytest.mark.parametrize("reserves", [True, False])
def test_admission_reserves_the_rest_of_admitted_prompts(reserves: bool) -> None:
    """Two 3,000-token prompts beside eight decodes in a pool that holds one and a half of
    them: paced, each would be admitted on its first small chunk and the two would outgrow the
    pool together (preemptions); reserving the rest of every admitted prompt, the second waits
    for the first to finish, and nothing is preempted."""
    engine, _, _ = make_engine(
        a=0.02,
        b=0.0005,
        num_kv_blocks=1200,
        scheduling_policy="slo",
        traffic_classes=SPEC.format(long=15000),
        max_num_batched_tokens=2048,
    )
    sched = engine.scheduler
    if not reserves:  # the slo policy without its prompt reservation
        margin = int(engine.config.scheduler.safety_margin * sched.kv.num_blocks)
        sched.admission.reserve = PromptReserve(sched.kv, margin, reserves_prompts=False)
    arrivals = [Arrival(0.0, f"d{i}", toks(8, i), params(40)) for i in range(8)]
    arrivals += [Arrival(0.01 * k, f"l{k}", toks(3000, 900 + k), params(8)) for k in range(2)]
    out = drive(engine, arrivals)
    assert len(out) == 10 and sched.kv_cache_usage == 0.0
    if reserves:
        assert sched.num_preemptions_total == 0
        # The second long prompt started only once the first had its whole prompt computed.
        first, second = out["l0"].times, out["l1"].times
        assert first is not None and second is not None
        assert second.first_scheduled is not None and first.first_token is not None
        assert second.first_scheduled >= first.first_token
    else:
        assert sched.num_preemptions_total > 0
