"""The teaching batching modes (static, dynamic) and cache-aware ordering (lpm), on the synthetic
step cost a + b x tokens of tests/unit/timed.py."""

from __future__ import annotations

import random

import pytest

from tests.unit.test_policies import admitted_order, toks
from tests.unit.timed import Arrival, Result, drive, make_engine, params


def batches(out: dict[str, Result]) -> list[list[str]]:
    """Requests grouped by the step that first scheduled them, in time order."""
    starts: dict[float, list[str]] = {}
    for rid, res in out.items():
        assert res.times is not None and res.times.first_scheduled is not None
        starts.setdefault(res.times.first_scheduled, []).append(rid)
    return [sorted(starts[t]) for t in sorted(starts)]


def random_arrivals(n: int, seed: int, span_s: float) -> list[Arrival]:
    rng = random.Random(seed)
    return [
        Arrival(
            rng.uniform(0, span_s), f"r{i}", toks(rng.randint(4, 80), i), params(rng.randint(1, 30))
        )
        for i in range(n)
    ]


def overlaps(out: dict[str, Result]) -> int:
    """Pairs where a request was admitted while an earlier-admitted one was still running."""
    times = [r.times for r in out.values() if r.times is not None]
    return sum(
        1
        for a in times
        for b in times
        if a.first_scheduled < b.first_scheduled < a.finished  # type: ignore[operator]
    )


def test_static_never_admits_while_a_batch_runs() -> None:
    arrivals = random_arrivals(40, 1, span_s=1.0)
    engine, _, _ = make_engine(scheduling_policy="static", max_num_seqs=8)
    out = drive(engine, arrivals)
    assert overlaps(out) == 0
    groups = batches(out)
    assert max(len(g) for g in groups) > 1  # batches, not one request at a time
    assert all(len(g) <= 8 for g in groups)
    # The same traffic under continuous batching does admit into a running batch (so the
    # check above can fail).
    engine, _, _ = make_engine(scheduling_policy="fifo", max_num_seqs=8)
    assert overlaps(drive(engine, arrivals)) > 0


def test_static_batch_waits_for_its_longest_output() -> None:
    engine, _, _ = make_engine(scheduling_policy="static", max_num_seqs=2)
    arrivals = [
        Arrival(0.0, "long-out", toks(8, 1), params(40)),
        Arrival(0.0, "short-out", toks(8, 2), params(2)),
        Arrival(0.001, "next", toks(8, 3), params(2)),
    ]
    out = drive(engine, arrivals)
    nxt, long_out = out["next"].times, out["long-out"].times
    assert nxt is not None and long_out is not None
    # "short-out" finished after 2 tokens, but its slot stays empty until the batch is done.
    assert nxt.first_scheduled == long_out.finished


def test_dynamic_waits_at_most_its_limit() -> None:
    delay = 0.05
    # Alone in an idle engine, a request waits the whole delay for company, no longer.
    engine, _, _ = make_engine(scheduling_policy="dynamic", max_batch_delay_ms=delay * 1000)
    out = drive(engine, [Arrival(0.2, "alone", toks(8, 0), params(3))])
    assert out["alone"].times.first_scheduled == pytest.approx(0.2 + delay)  # type: ignore[union-attr]
    # A full batch (max_num_seqs requests) goes at once.
    engine, _, _ = make_engine(
        scheduling_policy="dynamic", max_num_seqs=4, max_batch_delay_ms=delay * 1000
    )
    out = drive(engine, [Arrival(0.2, f"f{i}", toks(8, i), params(3)) for i in range(4)])
    assert {r.times.first_scheduled for r in out.values()} == {0.2}  # type: ignore[union-attr]
    # Random traffic: every batch starts by the later of the previous batch's end and its own
    # oldest member's arrival + delay, and batches do not overlap.
    arrivals = random_arrivals(40, 2, span_s=2.0)
    at = {a.rid: a.t for a in arrivals}
    engine, _, _ = make_engine(
        scheduling_policy="dynamic", max_num_seqs=6, max_batch_delay_ms=delay * 1000
    )
    out = drive(engine, arrivals)
    assert overlaps(out) == 0
    prev_end, waited = 0.0, 0
    for group in batches(out):
        start = out[group[0]].times.first_scheduled  # type: ignore[union-attr]
        oldest = min(at[r] for r in group)
        assert start <= max(prev_end, oldest + delay) + 1e-9, group
        waited += start > max(prev_end, oldest) + 1e-9
        prev_end = max(out[r].times.finished for r in group)  # type: ignore[union-attr,type-var]
    assert waited > 0  # some batch did hold back for company


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    engine, executor, clock = make_engine(
        scheduling_policy="lpm", max_num_seqs=1, enable_prefix_caching=True
    )
    shared = toks(32, 1)
    drive(engine, [Arrival(0.0, "seed", shared + [7], params(1))])  # caches 8 blocks
    t = clock.now()
    arrivals = [
        Arrival(t, "miss", toks(33, 2), params(2)),
        Arrival(t, "half", shared[:16] + toks(17, 4), params(2)),
        Arrival(t, "hit", shared + [9], params(2)),
    ]
    drive(engine, arrivals)
    assert [o for o in admitted_order(executor) if o != "seed"] == ["hit", "half", "miss"]
    # fifo on the same traffic keeps arrival order: the cache does not reorder the queue.
    engine, executor, clock = make_engine(max_num_seqs=1, enable_prefix_caching=True)
    drive(engine, [Arrival(0.0, "seed", shared + [7], params(1))])
    drive(engine, arrivals)
    assert [o for o in admitted_order(executor) if o != "seed"] == ["miss", "half", "hit"]


def test_lpm_aging_bounds_the_wait_of_a_request_without_a_cached_prefix() -> None:
    engine, executor, clock = make_engine(
        scheduling_policy="lpm",
        max_num_seqs=1,
        enable_prefix_caching=True,
        priority_aging_s=0.05,
    )
    shared = toks(32, 1)
    drive(engine, [Arrival(0.0, "seed", shared + [7], params(1))])
    t = clock.now()
    # "old" has no cached prefix but has waited past one aging period when the slot frees.
    arrivals = [
        Arrival(t, "busy", shared + [5], params(20)),
        Arrival(t, "old", toks(33, 2), params(2)),
    ] + [Arrival(t + 0.01, f"hit{i}", shared + [i], params(2)) for i in range(3)]
    drive(engine, arrivals)
    order = [o for o in admitted_order(executor) if o != "seed"]
    assert order[:2] == ["busy", "old"]


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_batching_modes_keep_outputs_under_preemption(policy: str) -> None:
    """A batch bigger than the KV pool preempts (recompute) and still yields the tokens of
    continuous batching on a pool that never runs out; no block leaks (drive checks)."""
    arrivals = random_arrivals(30, 3, span_s=0.3)
    reference, _, _ = make_engine(num_kv_blocks=4096)
    expected = {k: v.tokens for k, v in drive(reference, arrivals).items()}
    engine, _, _ = make_engine(
        scheduling_policy=policy,
        num_kv_blocks=48,
        safety_margin=0.0,
        max_num_batched_tokens=1024,
        max_batch_delay_ms=20.0,
        enable_prefix_caching=True,
    )
    out = drive(engine, arrivals)
    assert {k: v.tokens for k, v in out.items()} == expected
    assert engine.scheduler.num_preemptions_total > 0
