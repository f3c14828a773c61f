"""One simulated load point (a *cell*): requests through the real engine on a virtual clock.

``simulate_cell(engine_config, cost_model, cell, seed)`` builds a real ``EngineCore`` (the same
Scheduler and KVCacheManager as ``poise serve``) around a ``SimExecutor`` and a
``VirtualClock``, feeds it the cell's requests and returns per-request results plus the server
view (one ``SimStep`` per engine step: tokens, running, waiting, KV usage, preemptions).

The pieces: ``cell`` (the data in and out), ``driver`` (the client loop and the engine loop,
as ``poise bench`` drives a server), ``arrival`` (when a sent request reaches the engine:
request overhead, its spread, the server's way-in workers; docs/simulator.md, Client model),
``executor`` (a step's time from the cost model, on the virtual clock).

Invariants: deterministic for a given (config, cost model, arrival model, cell, seed): no wall clock, no
unseeded randomness, no dict-order dependence beyond insertion order; the engine code is not
modified or subclassed.
"""

from __future__ import annotations

from collections.abc import Sequence

from poise.config import EngineConfig
from poise.engine.clock import VirtualClock
from poise.engine.core import EngineCore
from poise.engine.executor import Executor
from poise.engine.observer import EngineObserver
from poise.sim.arrival import ArrivalModel
from poise.sim.cell import SimCell, SimRequest, SimRequestResult, SimResult, SimStep
from poise.sim.cost import CostModel
from poise.sim.driver import drive
from poise.sim.executor import DecisionRecorder, SimExecutor, pick_token_id
from poise.sim.speculation import SimProposer

__all__ = [
    "SimCell",
    "SimRequest",
    "SimRequestResult",
    "SimResult",
    "SimStep",
    "drive",
    "simulate_cell",
]


def sim_engine(
    engine_config: EngineConfig,
    cost_model: CostModel,
    executor: Executor,
    clock: VirtualClock,
    observers: Sequence[EngineObserver] = (),
) -> EngineCore:
    """A real ``EngineCore`` sized by the cost model (KV blocks, model length, vocabulary);
    with speculation, its proposer is ``SimProposer`` (a draft always) and the cost model's
    acceptance rate says how many drafts each verify keeps."""
    proposer = None
    if engine_config.scheduler.speculative_config is not None:
        if cost_model.spec_acceptance_rate is None:
            raise ValueError(
                "speculative_config: the simulator needs the drafts' acceptance rate "
                "(--spec-acceptance-rate, docs/speculation.md)"
            )
        token = pick_token_id(cost_model.eos_token_ids, cost_model.vocab_size)
        proposer = SimProposer(token, cost_model.spec_draft_rate)
    return EngineCore(
        engine_config,
        executor,
        num_kv_blocks=cost_model.num_kv_blocks(engine_config),
        max_model_len=cost_model.max_model_len(engine_config),
        vocab_size=cost_model.vocab_size,
        eos_token_ids=frozenset(cost_model.eos_token_ids),
        clock=clock,
        observers=observers,
        proposer=proposer,
    )


def simulate_cell(
    engine_config: EngineConfig,
    cost_model: CostModel,
    cell: SimCell,
    seed: int = 0,
    *,
    arrival: ArrivalModel = ArrivalModel(),
    record_decisions: bool = False,
) -> SimResult:
    """Run one cell through ``EngineCore`` + ``SimExecutor`` in virtual time.

    ``seed`` seeds the synthetic prompt token ids (only their identity matters, for prefix
    caching); everything else is deterministic. With ``record_decisions`` the result keeps each
    step's ``StepDecision``.
    """
    clock = VirtualClock(0.0)
    sim = SimExecutor(cost_model, clock, seed=seed)
    recorder = DecisionRecorder()
    engine = sim_engine(
        engine_config, cost_model, sim, clock, [recorder] if record_decisions else []
    )
    num_blocks = engine.kv.num_blocks
    results, timeline, wall = drive(engine, clock, cell, arrival=arrival, seed=seed)
    first = min((r.sent for r in results), default=0.0)
    last = max((r.finished or r.sent for r in results), default=0.0)
    return SimResult(
        requests=results,
        timeline=timeline,
        duration_s=last - first,
        wall_s=wall,
        num_steps=sim.num_steps,
        busy_s=sim.busy_s,
        num_kv_blocks=num_blocks,
        max_model_len=engine.max_model_len,
        cost_model=cost_model.describe(),
        arrival_model=arrival.describe(),
        decisions=recorder.decisions,
    )
