"""N engine replicas behind poise's router, in virtual time (``poise simulate --replicas N``).

Each replica is a real ``EngineCore`` (scheduler, KV manager) with its own ``SimExecutor`` and
``VirtualClock``; the client loop is the single-engine simulator's (``simulator._Driver``), and
every request goes through ``poise.router.Router`` (the code ``poise serve --replicas`` routes
with) when it reaches the front end. Events run in time order: a send, a request reaching the
router, or a replica's step boundary (where the step's results land and its next step starts).
A replica's clock never runs behind the router's: an idle one is brought forward to the
request it receives, a busy one is at the end of its current step.

With ``shared_cpu`` the replicas share one host's cores with the traffic's relay: each step
takes its cost over the engine's share of a core when it starts (``sim/cpu_share.py``: the
replicas busy then, the host's request and token rates over the last window).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from poise.config import EngineConfig
from poise.core.outputs import RequestDelta, StepStats
from poise.engine.clock import VirtualClock
from poise.engine.core import EngineCore
from poise.router import ReplicaState, Router, RouterConfig, RouteRequest
from poise.sim.arrival import ArrivalModel, WayIn
from poise.sim.cell import SimCell, SimResult
from poise.sim.cost import CostModel
from poise.sim.cpu_share import RateWindow, SharedCpu
from poise.sim.driver import _Driver
from poise.sim.executor import SimExecutor
from poise.sim.simulator import sim_engine

# A replica that schedules nothing this many times in a row (without its clock moving) waits
# for a new request rather than spinning.
_STALL = 3


@dataclass
class ClusterResult(SimResult):
    replicas: int = 1
    router: dict[str, Any] = field(default_factory=dict)
    replica_of: dict[str, str] = field(default_factory=dict)  # request id -> replica name
    # With a SharedCpu: the mean over steps of the engine's share of a core (1 otherwise).
    mean_engine_share: float = 1.0


class _ClusterDriver(_Driver):
    def __init__(
        self,
        engines: Sequence[EngineCore],
        clocks: Sequence[VirtualClock],
        router: Router,
        cell: SimCell,
        way_in: WayIn,
        seed: int,
        sims: Sequence[SimExecutor] = (),
        shared_cpu: SharedCpu | None = None,
    ) -> None:
        super().__init__(engines[0], clocks[0], cell, way_in, seed)
        self.engines, self.clocks, self.router = list(engines), list(clocks), router
        self.sims, self.shared_cpu = list(sims), shared_cpu
        window = shared_cpu.window_s if shared_cpu else 1.0
        self.request_rate, self.token_rate = RateWindow(window), RateWindow(window)
        self.shares: list[float] = []
        self.names = [f"replica-{i}" for i in range(len(engines))]
        self.now = 0.0
        self.pending: list[list[RequestDelta] | None] = [None] * len(engines)
        self.stalls = [0] * len(engines)
        self.replica_of: dict[str, str] = {}
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def deliver(self, now: float) -> None:
        while self.inbox and self.inbox[0][0] <= now:
            t_engine, _, res, req = heapq.heappop(self.inbox)
            ids = self.token_ids(req)
            decision = self.router.route(
                RouteRequest(res.request_id, ids, req.max_tokens, req.traffic_class)
            )
            i = self.names.index(decision.replica)
            self.replica_of[res.request_id] = decision.replica
            self.request_rate.add(t_engine)
            engine, clock = self.engines[i], self.clocks[i]
            if not engine.has_unfinished_requests() and self.pending[i] is None:
                clock.advance_to(max(clock.now(), t_engine))
            self.stalls[i] = 0
            if not self.submit(engine, res, req, ids, t_engine):
                self.router.on_finish(res.request_id)  # refused: the router forgets it

    def apply(self, deltas: list[RequestDelta]) -> None:
        for d in deltas:
            if d.new_token_ids:
                self.router.on_tokens(d.request_id, len(d.new_token_ids))
                self.token_rate.add(self.now, len(d.new_token_ids))
            if d.finished:
                self.router.on_finish(d.request_id)
                self.prompt_tokens += d.num_prompt_tokens
                self.cached_tokens += d.num_cached_tokens
        super().apply(deltas)

    def _observe(self, i: int, stats: StepStats) -> None:
        self.record(stats)
        tokens = stats.num_prefill_tokens + stats.num_decode_tokens
        self.router.observe_step(self.names[i], tokens, stats.end_time - stats.start_time)

    def _busy(self, i: int) -> bool:
        return self.pending[i] is not None or (
            self.engines[i].has_unfinished_requests() and self.stalls[i] < _STALL
        )

    def _share_cores(self, i: int) -> None:
        """Replica ``i`` is about to step: its engine's share of a core from now on."""
        if self.shared_cpu is None:
            return
        busy = sum(1 for j in range(len(self.engines)) if j == i or self._busy(j))
        share = self.shared_cpu.engine_share(
            busy, self.request_rate.rate(self.now), self.token_rate.rate(self.now)
        )
        self.sims[i].slowdown = 1.0 / share

    def _replica_events(self) -> list[tuple[float, int]]:
        events = []
        for i, e in enumerate(self.engines):
            if self._busy(i):
                events.append((self.clocks[i].now(), i))
            elif e.has_unfinished_requests() and (wake := e.wake_time()) is not None:
                events.append((wake, i))  # a dynamic batch that starts at its delay
        return events

    def run(self) -> None:
        while True:
            self.send_due(self.now)
            self.deliver(self.now)
            client = [t for t in (self.next_send_time(),) if t is not None]
            if self.inbox:
                client.append(self.inbox[0][0])
            replicas = self._replica_events()
            if not client and not replicas:
                if any(e.has_unfinished_requests() for e in self.engines):
                    raise RuntimeError("simulator: a replica holds requests it never schedules")
                return
            t_client = min(client, default=float("inf"))
            t_rep, i = min(replicas, default=(float("inf"), -1))
            if t_client <= t_rep:
                self.now = max(self.now, t_client)
                continue
            self.now = max(self.now, t_rep)
            if self.pending[i] is not None:
                deltas, self.pending[i] = self.pending[i], None
                self.apply(deltas or [])
                continue
            if self.clocks[i].now() < t_rep:  # woken by its own policy (wake_time)
                self.clocks[i].advance_to(t_rep)
                self.stalls[i] = 0
            self._share_cores(i)
            deltas, stats = self.engines[i].step()
            if stats is None:
                self.apply(deltas)  # requests rejected on admission
                self.stalls[i] += 1
                continue
            self.stalls[i] = 0
            if self.shared_cpu is not None:
                self.shares.append(1.0 / self.sims[i].slowdown)
            self._observe(i, stats)
            self.pending[i] = deltas


def simulate_cluster(
    engine_config: EngineConfig,
    cost_model: CostModel,
    cell: SimCell,
    *,
    replicas: int,
    router_config: RouterConfig | None = None,
    pools: Sequence[str | None] | None = None,
    seed: int = 0,
    arrival: ArrivalModel = ArrivalModel(),
    shared_cpu: SharedCpu | None = None,
) -> ClusterResult:
    """Run ``cell`` through ``replicas`` copies of the engine behind the router.

    ``pools`` names each replica's class pool (None: serves every class); ``shared_cpu``:
    the replicas share one host's cores (None: each has its own device).
    """
    if replicas < 1:
        raise ValueError(f"replicas: must be >= 1, got {replicas}")
    if pools is not None and len(pools) != replicas:
        raise ValueError(f"pools: one per replica ({replicas}), got {len(pools)}")
    cfg = router_config or RouterConfig()
    cfg = dataclasses.replace(cfg, block_size=engine_config.cache.block_size)
    clocks = [VirtualClock(0.0) for _ in range(replicas)]
    sims = [SimExecutor(cost_model, c, seed=seed + i) for i, c in enumerate(clocks)]
    num_blocks = cost_model.num_kv_blocks(engine_config)
    engines = [
        sim_engine(engine_config, cost_model, sim, clock)
        for sim, clock in zip(sims, clocks, strict=True)
    ]
    states = [
        ReplicaState(
            f"replica-{i}",
            pool=pools[i] if pools else None,
            budget=engine_config.scheduler.max_num_batched_tokens,
            max_num_seqs=engine_config.scheduler.max_num_seqs,
        )
        for i in range(replicas)
    ]
    router = Router(states, cfg)
    driver = _ClusterDriver(
        engines, clocks, router, cell, WayIn(arrival, seed), seed, sims, shared_cpu
    )
    t0 = time.perf_counter()
    driver.run()
    wall = time.perf_counter() - t0
    results = sorted(driver.done, key=lambda r: r.index)
    first = min((r.sent for r in results), default=0.0)
    last = max((r.finished or r.sent for r in results), default=0.0)
    counts = {n: sum(1 for v in driver.replica_of.values() if v == n) for n in driver.names}
    return ClusterResult(
        requests=results,
        timeline=sorted(driver.timeline, key=lambda s: s.start_time),
        duration_s=last - first,
        wall_s=wall,
        num_steps=sum(s.num_steps for s in sims),
        busy_s=sum(s.busy_s for s in sims),
        num_kv_blocks=num_blocks,
        max_model_len=engines[0].max_model_len,
        cost_model=cost_model.describe(),
        arrival_model=arrival.describe(),
        replicas=replicas,
        router={
            "policy": cfg.policy,
            "decisions": dict(router.decisions),
            "affinity_hit_rate": round(router.affinity_hit_rate, 4),
            "retries": router.retries,
            "requests_per_replica": counts,
            "prefix_cache_hit_rate": round(driver.cached_tokens / driver.prompt_tokens, 4)
            if driver.prompt_tokens
            else 0.0,
        },
        replica_of=driver.replica_of,
        mean_engine_share=sum(driver.shares) / len(driver.shares) if driver.shares else 1.0,
    )
