"""Replicas that share a host's cores with their traffic's relay (sim/cpu_share.py)."""

from __future__ import annotations

import pytest

from poise.config import EngineConfig
from poise.router import RouterConfig
from poise.sim.cluster import simulate_cluster
from poise.sim.cost import FixedCostModel
from poise.sim.cpu_share import MIN_SHARE, RateWindow, SharedCpu, fit_relay
from poise.sim.simulator import SimCell, SimRequest

COST = FixedCostModel(step_s=0.01, per_token_s=1e-4, vocab_size=1000, model_max_len=4096)


def test_engine_share_is_what_the_relay_leaves_split_evenly() -> None:
    cpu = SharedCpu(
        cores=2, background_cores=0.1, relay_s_per_request=0.01, relay_s_per_token=0.002
    )
    assert cpu.relay_cores(10, 200) == pytest.approx(0.1 + 0.1 + 0.4)
    assert cpu.engine_share(1, 10, 200) == 1.0  # one engine: a core is free
    assert cpu.engine_share(2, 10, 200) == pytest.approx(1.4 / 2)
    assert cpu.engine_share(2, 0, 0) == pytest.approx(0.95)
    assert cpu.engine_share(4, 0, 100_000) == MIN_SHARE  # saturated: the floor
    assert SharedCpu(cores=2).engine_share(2, 50, 5000) == 1.0  # a free relay takes nothing
    with pytest.raises(ValueError):
        SharedCpu(cores=0)
    with pytest.raises(ValueError):
        SharedCpu(cores=2, relay_s_per_token=-1)


def test_rate_window_forgets_what_is_older_than_the_window() -> None:
    w = RateWindow(1.0)
    w.add(0.0, 10)
    w.add(0.5, 10)
    assert w.rate(0.9) == 20
    assert w.rate(1.2) == 10  # the first left the window
    assert w.rate(5.0) == 0


def test_fit_relay_separates_the_per_request_and_per_token_costs() -> None:
    samples = [(n, 0.02 + 0.003 * n) for n in (32, 128, 32, 128)]
    per_request, per_token = fit_relay(samples)
    assert per_request == pytest.approx(0.02) and per_token == pytest.approx(0.003)
    # One length: all of it per token.
    assert fit_relay([(32, 0.064), (32, 0.064)]) == (0.0, pytest.approx(0.002))
    # Longer requests costing less: the lengths explain nothing, a per-request cost.
    assert fit_relay([(10, 0.05), (100, 0.03)]) == (pytest.approx(0.04), 0.0)
    with pytest.raises(ValueError):
        fit_relay([])


def _cell(n: int, rate: float) -> SimCell:
    reqs = [SimRequest(i, 64, 32, arrival=i / rate, prompt_key=str(i)) for i in range(n)]
    return SimCell(reqs, open_loop=True)


def test_replicas_on_shared_cores_step_slower_when_the_relay_takes_a_core() -> None:
    config = EngineConfig.from_kwargs(max_num_seqs=8, max_num_batched_tokens=256)
    rr = RouterConfig(policy="round_robin")
    own = simulate_cluster(config, COST, _cell(40, 100.0), replicas=2, router_config=rr)
    roomy = simulate_cluster(
        config, COST, _cell(40, 100.0), replicas=2, router_config=rr, shared_cpu=SharedCpu(cores=2)
    )
    # Two cores, two engines, a free relay: as if each had its own device.
    assert [r.token_times for r in roomy.requests] == [r.token_times for r in own.requests]
    assert own.mean_engine_share == roomy.mean_engine_share == 1.0
    tight = SharedCpu(cores=2, background_cores=0.5, relay_s_per_token=0.001)
    shared = simulate_cluster(
        config, COST, _cell(40, 100.0), replicas=2, router_config=rr, shared_cpu=tight
    )
    assert all(r.ok for r in shared.requests)
    assert 0.3 < shared.mean_engine_share < 0.8
    assert shared.busy_s > 1.2 * own.busy_s
    assert shared.duration_s > own.duration_s
    # One replica alone keeps a whole core while 1.5 are free.
    one = simulate_cluster(
        config,
        COST,
        _cell(20, 50.0),
        replicas=1,
        router_config=rr,
        shared_cpu=SharedCpu(cores=2, background_cores=0.5),
    )
    assert one.mean_engine_share == 1.0
