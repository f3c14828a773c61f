"""N replicas of the real engine behind the router, in virtual time."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from poise.cli import main
from poise.config import EngineConfig
from poise.router import RouterConfig
from poise.sim.cluster import simulate_cluster
from poise.sim.cost import FixedCostModel
from poise.sim.simulator import SimCell, SimRequest, simulate_cell

COST = FixedCostModel(step_s=0.01, per_token_s=1e-4, vocab_size=1000, model_max_len=4096)


def _config(**kw: object) -> EngineConfig:
    base: dict[str, object] = dict(max_num_seqs=8, max_num_batched_tokens=256, block_size=16)
    base.update(kw)
    return EngineConfig.from_kwargs(**base)


def _shared_prompts(n: int, systems: int = 4, rate: float = 40.0) -> list[SimRequest]:
    # Each request's prompt is one of a few system prompts (same token ids by prompt_key) then
    # its own question: modelled as prompts of the same key and length sharing a prefix.
    return [
        SimRequest(i, 400, 16, arrival=i / rate, prompt_key=f"sys{i % systems}") for i in range(n)
    ]


def test_one_replica_is_the_single_engine_simulator() -> None:
    cell = SimCell(_shared_prompts(30), open_loop=True)
    one = simulate_cell(_config(), COST, cell, seed=1)
    cluster = simulate_cluster(
        _config(), COST, cell, replicas=1, seed=1, router_config=RouterConfig(policy="round_robin")
    )
    assert [r.token_times for r in cluster.requests] == [r.token_times for r in one.requests]
    assert cluster.num_steps == one.num_steps


def test_requests_split_over_replicas_and_all_finish() -> None:
    cell = SimCell(_shared_prompts(40, rate=200.0), open_loop=True)
    res = simulate_cluster(
        _config(), COST, cell, replicas=2, router_config=RouterConfig(policy="round_robin")
    )
    assert all(r.ok for r in res.requests) and len(res.requests) == 40
    assert res.router["requests_per_replica"] == {"replica-0": 20, "replica-1": 20}
    # Two replicas in parallel: the same load finishes sooner than on one.
    single = simulate_cluster(_config(), COST, cell, replicas=1)
    assert res.duration_s < 0.8 * single.duration_s


def test_prefix_affinity_keeps_each_system_prompt_on_one_replica_and_hits_the_cache() -> None:
    # 5 system prompts over 4 replicas: round robin sends each to every replica.
    cell = SimCell(_shared_prompts(40, systems=5, rate=20.0), open_loop=True)
    rr = simulate_cluster(
        _config(), COST, cell, replicas=4, router_config=RouterConfig(policy="round_robin")
    )
    pa = simulate_cluster(
        _config(), COST, cell, replicas=4, router_config=RouterConfig(policy="prefix_affinity")
    )
    by_key: dict[str, set[str]] = {}
    for req in cell.requests:
        by_key.setdefault(req.prompt_key, set()).add(pa.replica_of[f"sim-{req.index}"])
    assert all(len(v) == 1 for v in by_key.values()), by_key
    assert pa.router["prefix_cache_hit_rate"] > rr.router["prefix_cache_hit_rate"] + 0.2
    assert pa.router["decisions"]["affinity_hit"] == 35


@pytest.mark.parametrize("policy", ["least_loaded", "balanced"])
def test_load_aware_policies_beat_round_robin_on_a_long_short_mix(policy: str) -> None:
    # Every other request is long: round robin puts all the long ones on one replica, where
    # they queue behind each other while the other replica idles between short ones.
    reqs = [
        SimRequest(i, 2000 if i % 2 == 0 else 30, 8, arrival=i * 0.05, prompt_key=f"u{i}")
        for i in range(40)
    ]
    cell = SimCell(reqs, open_loop=True)

    def ttft_p95(p: str) -> float:
        res = simulate_cluster(
            _config(), COST, cell, replicas=2, router_config=RouterConfig(policy=p)
        )
        ttfts = sorted(r.ttft or 0.0 for r in res.requests)
        return ttfts[int(0.95 * (len(ttfts) - 1))]

    assert ttft_p95(policy) < 0.6 * ttft_p95("round_robin")


def test_pools_and_closed_loop_run_and_are_deterministic() -> None:
    reqs = [SimRequest(i, 1500 if i % 3 == 0 else 40, 8, prompt_key=f"k{i}") for i in range(30)]
    cell = SimCell(reqs, concurrency=4)
    cfg = RouterConfig(policy="least_loaded", long_prompt_tokens=1000)
    a = simulate_cluster(
        _config(),
        COST,
        cell,
        replicas=3,
        router_config=cfg,
        pools=["long", "interactive", "interactive"],
    )
    b = simulate_cluster(
        _config(),
        COST,
        cell,
        replicas=3,
        router_config=cfg,
        pools=["long", "interactive", "interactive"],
    )
    assert [r.token_times for r in a.requests] == [r.token_times for r in b.requests]
    assert all(r.ok for r in a.requests)
    short_on_long_pool = [
        r
        for r in a.requests
        if r.num_prompt_tokens < 1000 and a.replica_of[r.request_id] == "replica-0"
    ]
    spills = sum(v for k, v in a.router["decisions"].items() if k.endswith("+spill"))
    assert len(short_on_long_pool) <= spills


def test_bad_replica_counts_are_refused() -> None:
    cell = SimCell([SimRequest(0, 10, 2)], concurrency=1)
    with pytest.raises(ValueError, match="replicas"):
        simulate_cluster(_config(), COST, cell, replicas=0)
    with pytest.raises(ValueError, match="pools"):
        simulate_cluster(_config(), COST, cell, replicas=2, pools=["long"])


def test_simulate_cli_runs_replicas_behind_a_router(tmp_path: Path) -> None:
    out = tmp_path / "sim.yaml"
    args = [
        "simulate",
        "--accelerator",
        "a10",
        "--model-shape",
        "SmolLM2-135M-Instruct",
        "--concurrency",
        "8",
        "--num-requests",
        "24",
        "--max-tokens",
        "8",
        "--long-ratio",
        "0.25",
        "--replicas",
        "2",
        "--router",
        "least_loaded",
        "-o",
        str(out),
    ]
    assert main(args) == 0
    rec = yaml.safe_load(out.read_text())
    assert rec["experiment"]["replicas"] == 2 and rec["experiment"]["router"] == "least_loaded"
    (cell,) = rec["results"]
    per = cell["server"]["router"]["requests_per_replica"]
    assert set(per) == {"replica-0", "replica-1"} and all(v > 0 for v in per.values())
    assert cell["metrics"]["overall"]["num_ok"] == 24


def test_simulate_cli_refuses_pools_that_do_not_match_the_replicas(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [
        "simulate",
        "--accelerator",
        "a10",
        "--concurrency",
        "2",
        "--replicas",
        "2",
        "--router-pools",
        "long",
    ]
    assert main(args) == 2
    assert "--router-pools" in capsys.readouterr().err


def test_real_token_ids_share_only_their_common_opening() -> None:
    # A replayed workload: two prompts with the same 64-token opening (4 blocks) and their own
    # tails. With real ids the second hits exactly those 4 blocks; as synthetic ids of two
    # different keys it would hit nothing.
    opening = tuple(range(100, 164))
    tails = [tuple(range(500 + 36 * i, 536 + 36 * i)) for i in range(2)]
    reqs = [SimRequest(i, 100, 4, arrival=float(i), token_ids=opening + tails[i]) for i in range(2)]
    res = simulate_cluster(_config(), COST, SimCell(reqs, open_loop=True), replicas=1)
    assert [r.num_cached_tokens for r in res.requests] == [0, 64]
    with pytest.raises(ValueError, match="token_ids"):
        SimRequest(0, 10, 4, token_ids=(1, 2, 3))
