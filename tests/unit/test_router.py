"""The router's policies, pools, prefix table and failure handling (pure Python)."""

from __future__ import annotations

import pytest

from poise.kv.block_pool import prefix_keys
from poise.router import ReplicaState, Router, RouterConfig, RouteRequest

BS = 16


def _router(policy: str, n: int = 2, pools: list[str | None] | None = None, **kw: int) -> Router:
    pools = pools or [None] * n
    reps = [ReplicaState(f"r{i}", pool=pools[i]) for i in range(n)]
    return Router(reps, RouterConfig(policy=policy, block_size=BS, **kw))


def _req(rid: str, tokens: list[int], max_tokens: int = 8, cls: str | None = None) -> RouteRequest:
    return RouteRequest(rid, tokens, max_tokens, cls)


SYSTEM_A = list(range(100, 164))  # 4 blocks
SYSTEM_B = list(range(500, 564))


def test_round_robin_cycles_whatever_the_load() -> None:
    r = _router("round_robin", 3)
    got = [r.route(_req(f"q{i}", [i] * 40)).replica for i in range(6)]
    assert got == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert r.decisions["round_robin"] == 6


def test_least_loaded_fills_the_emptier_replica_and_follows_finishes() -> None:
    r = _router("least_loaded")
    assert r.route(_req("a", [1] * 40)).replica == "r0"
    assert r.route(_req("b", [2] * 40)).replica == "r1"
    assert r.route(_req("c", [3] * 40)).replica == "r0"  # tie on count, r0 first
    r.on_finish("b")
    assert r.route(_req("d", [4] * 40)).replica == "r1"
    # Same count: fewer prompt tokens still to prefill wins.
    r2 = _router("least_loaded")
    r2.route(_req("big", [1] * 2000))
    r2.route(_req("small", [2] * 20))
    assert r2.route(_req("next", [3] * 20)).replica == "r1"


def test_prefix_affinity_sends_a_repeated_system_prompt_to_one_replica() -> None:
    r = _router("prefix_affinity", 3)
    first_a = r.route(_req("a0", SYSTEM_A + [1, 2, 3]))
    first_b = r.route(_req("b0", SYSTEM_B + [1, 2, 3]))
    assert first_a.reason == first_b.reason == "affinity_miss"
    assert first_a.replica != first_b.replica  # misses spread by load
    for i in range(4):
        d = r.route(_req(f"a{i + 1}", SYSTEM_A + [7, i]))
        assert (d.replica, d.reason) == (first_a.replica, "affinity_hit")
        assert d.cached_tokens == 64
    assert r.route(_req("b1", SYSTEM_B + [9])).replica == first_b.replica
    assert r.affinity_hits == 5 and r.affinity_lookups == 7
    assert r.affinity_hit_rate == pytest.approx(5 / 7)


def test_prefix_affinity_matches_the_longest_shared_run_of_blocks() -> None:
    r = _router("prefix_affinity", 2, max_imbalance=0)
    doc = list(range(1000, 1160))  # 10 blocks
    r.route(_req("x", doc[:32] + [1] * 40))  # shares 2 blocks with doc
    # A 2-block hit on r0, but r0 leads r1 by one request: by load, to r1 (all 10 blocks).
    assert r.route(_req("y", doc + [2])).reason == "affinity_overloaded"
    d = r.route(_req("z", doc + [3]))
    assert d.replica == "r1" and d.cached_tokens == 160


def test_prefix_affinity_falls_back_to_load_when_the_affine_replica_is_overloaded() -> None:
    r = _router("prefix_affinity", 2, max_imbalance=2)
    reasons = [r.route(_req(f"a{i}", SYSTEM_A + [i])).reason for i in range(5)]
    # miss, hit, hit (r0 leads by 2), then r0 would lead by 3: overloaded -> r1.
    assert reasons[:3] == ["affinity_miss", "affinity_hit", "affinity_hit"]
    assert reasons[3] == "affinity_overloaded"
    # r1 ran the prompt too: both hold it, so neither is preferred; by load.
    assert r.route(_req("a9", SYSTEM_A + [9])).reason == "affinity_miss"


def test_prefix_keys_are_the_kv_caches_own_chain() -> None:
    from poise.core.request import Request
    from poise.core.sampling_params import SamplingParams
    from poise.kv.manager import KVCacheManager

    tokens = list(range(50))
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    req = Request("k", tokens, SamplingParams(max_tokens=1), 0.0)
    kv.allocate_slots("k", num_computed_tokens=0, num_new_tokens=len(tokens))
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req, req.num_computed_tokens)
    keys = prefix_keys(tokens, BS, 8)
    assert len(keys) == 3
    assert [kv.pool.lookup(k) for k in keys] == kv.get_block_ids("k")[:3]


def test_balanced_prefers_a_warm_cache_until_its_queue_costs_more() -> None:
    r = _router("balanced")
    long_doc = list(range(3000, 3000 + 1600))
    assert r.route(_req("d0", long_doc + [1])).replica == "r0"
    r.on_tokens("d0", 1)  # prefilled, now decoding
    d = r.route(_req("d1", long_doc + [2]))
    assert (d.replica, d.reason) == ("r0", "balanced_affinity")
    # A short prompt with no cache goes to the idle replica.
    d = r.route(_req("s", [5] * 20))
    assert (d.replica, d.reason) == ("r1", "balanced")
    # Pile unstarted long prompts onto r0: the warm cache stops paying for the queue.
    for i in range(6):
        r.replicas["r0"].inflight[f"pile{i}"] = type(r.replicas["r0"].inflight["d0"])(4000, 64)
    assert r.route(_req("d2", long_doc + [3])).replica == "r1"


def test_balanced_weighs_the_tokens_to_prefill_not_the_request_count() -> None:
    r = _router("balanced")
    r.route(_req("huge", [1] * 8000))  # r0: one request, 8000 tokens to prefill
    r.route(_req("s1", [2] * 10))  # r1: short ones
    r.route(_req("s2", [3] * 10))
    assert r.replicas["r1"].load == 2
    assert r.route(_req("s3", [4] * 10)).replica == "r1"


def test_pools_keep_long_prompts_off_the_interactive_replica_and_spill_when_idle() -> None:
    r = _router(
        "least_loaded", 3, pools=["long", "interactive", "interactive"], long_prompt_tokens=100
    )
    long_prompt = [1] * 500
    assert r.route(_req("l0", long_prompt)).replica == "r0"
    # r0 is busy and r1/r2 are idle: the long prompt is lent an interactive replica.
    d = r.route(_req("l1", long_prompt))
    assert d.replica in {"r1", "r2"} and d.reason == "least_loaded+spill"
    # Once no interactive replica is idle, long traffic stays in its pool.
    r.route(_req("s0", [2] * 10))
    assert r.route(_req("l2", long_prompt)).replica == "r0"
    # Short prompts never go to the long pool while their own pool exists.
    for i in range(5):
        assert r.route(_req(f"s{i + 1}", [3] * 10)).replica in {"r1", "r2"}
    # The request's named class wins over its length.
    assert r.traffic_class(_req("n", [1] * 10, cls="long")) == "long"


def test_a_failed_replica_leaves_rotation_and_hands_back_unstarted_requests() -> None:
    r = _router("round_robin", 2)
    reqs = {f"q{i}": _req(f"q{i}", [i] * 40) for i in range(4)}
    placed = {rid: r.route(q).replica for rid, q in reqs.items()}
    started = next(rid for rid, rep in placed.items() if rep == "r0")
    r.on_tokens(started, 3)
    lost = r.on_failure("r0")
    assert started not in lost
    assert sorted(lost) == sorted(
        rid for rid, rep in placed.items() if rep == "r0" and rid != started
    )
    for rid in lost:
        d = r.retry(reqs[rid], failed=["r0"])
        assert d.replica == "r1"
    assert r.retries == len(lost)
    assert all(r.route(_req(f"n{i}", [9] * 40)).replica == "r1" for i in range(3))
    r.mark_up("r0")
    assert {r.route(_req(f"m{i}", [8] * 40)).replica for i in range(2)} == {"r0", "r1"}


def test_no_healthy_replica_is_an_error_not_a_hang() -> None:
    r = _router("least_loaded", 1)
    r.on_failure("r0")
    with pytest.raises(RuntimeError, match="no healthy replica"):
        r.route(_req("x", [1] * 20))


def test_unknown_policy_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        RouterConfig(policy="random")


def test_prefix_affinity_ignores_an_opening_every_replica_holds() -> None:
    # A chat template puts the same header (here 2 blocks) before every prompt; following it
    # would send all traffic to the replica that served first.
    header = list(range(9000, 9032))
    r = _router("prefix_affinity", 2, max_imbalance=0)
    first = r.route(_req("p0", header + SYSTEM_A + [1]))
    # The header is on r0 only, but r0 is busier: to r1, which then holds the header too.
    assert r.route(_req("p1", header + SYSTEM_B + [1])).reason == "affinity_overloaded"
    r.on_finish("p0")
    r.on_finish("p1")
    got = [r.route(_req(f"q{i}", header + [7000 + i] * 40)) for i in range(4)]
    assert [d.reason for d in got] == ["affinity_miss"] * 4
    assert [d.replica for d in got] == ["r0", "r1", "r0", "r1"]  # by load, not by the header
    assert r.affinity_hits == 0
    # A prompt's own system prompt still finds its replica; the hit counts the whole prefix.
    d = r.route(_req("a", header + SYSTEM_A + [2]))
    assert (d.replica, d.reason, d.cached_tokens) == (first.replica, "affinity_hit", 32 + 64)
    assert r.affinity_hits == 1
