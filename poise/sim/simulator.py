"""One simulated load point (a *cell*): requests through the real engine on a virtual clock.

``simulate_cell(engine_config, cost_model, cell, seed)`` builds a real ``EngineCore`` (the same
Scheduler and KVCacheManager as ``poise serve``) around a ``SimExecutor`` and a
``VirtualClock``, feeds it the cell's requests and returns per-request results plus the server
view (one ``SimStep`` per engine step: tokens, running, waiting, KV usage, preemptions).

Client model (mirrors ``poise bench``):
- closed loop (``concurrency`` N): N requests are sent at t=0; each time one finishes, the next
  is sent at that (virtual) instant;
- open loop: request i is sent at ``requests[i].arrival``; with ``concurrency`` set it is a cap,
  and a request due while N are in flight is sent when a slot frees (``intended`` keeps the
  scheduled time).
A request reaches the engine ``cost_model.request_overhead_s`` after it is sent (HTTP,
template, tokenization); every latency is measured from the send time, as the client does.
With ``cost_model.request_overhead_cv`` > 0 each request's overhead is a seeded lognormal draw
of that mean and spread: requests sent together (a closed loop's start, a wave) then reach the
engine in a seeded random order, so the scheduler's first decisions, which set the closed
loop's waves for the rest of the cell, vary from seed to seed. With
``cost_model.way_in_workers`` > 0 the serial part of the overhead (``way_in_s_per_token`` x
prompt tokens: poise serve renders the chat template and tokenizes on one thread) is served
by that many workers in send order, after the rest of the overhead: a burst reaches the
engine in send order, spaced by its prompts' tokenization, which is what sets a closed
loop's first waves on the real server (docs/simulator.md, Client model).

Invariants: deterministic for a given (config, cost model, cell, seed): no wall clock, no
unseeded randomness, no dict-order dependence beyond insertion order; the engine code is not
modified or subclassed.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from poise.config import EngineConfig
from poise.core.outputs import RequestDelta, StepStats
from poise.core.sampling_params import SamplingParams
from poise.engine.clock import VirtualClock
from poise.engine.core import EngineCore
from poise.engine.executor import Executor
from poise.errors import InvalidRequestError, OverloadedError
from poise.sim.cost import CostModel
from poise.sim.executor import RecordingExecutor, SimExecutor


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated cell. Requests with the same ``prompt_key`` get the same
    synthetic token ids (so prefix caching sees identical prompts as identical)."""

    index: int
    prompt_len: int
    max_tokens: int
    arrival: float = 0.0  # open loop: send time (s from the cell start); ignored closed loop
    class_name: str = "default"
    prompt_key: str = ""
    warmup: bool = False
    ignore_eos: bool = True
    # Scheduling inputs, as a bench client sends them (``--priority``, ``--send-class``).
    priority: int = 0
    traffic_class: str | None = None


@dataclass(frozen=True)
class SimCell:
    requests: Sequence[SimRequest]
    # Closed loop with this many streams when ``open_loop`` is False; a cap on in-flight
    # requests in open loop (None = no cap).
    concurrency: int | None = None
    open_loop: bool = False
    # Stop sending new requests after this much virtual time (in-flight ones finish).
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if not self.open_loop and not self.concurrency:
            raise ValueError("SimCell.concurrency: a closed loop needs concurrency >= 1")


@dataclass
class SimRequestResult:
    index: int
    request_id: str
    class_name: str
    warmup: bool
    sent: float  # when the client sent it
    intended: float  # when the schedule wanted it sent
    num_prompt_tokens: int
    max_tokens: int
    token_times: list[float] = field(default_factory=list)
    first_scheduled: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("length", "stop")

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None


@dataclass(frozen=True)
class SimStep:
    """The server's view after one engine step (what Prometheus would show)."""

    start: float
    end: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    num_finished: int


@dataclass
class SimResult:
    requests: list[SimRequestResult]
    timeline: list[SimStep]
    duration_s: float  # virtual time from the first send to the last finish
    wall_s: float
    num_steps: int
    busy_s: float  # virtual time spent in steps
    num_kv_blocks: int
    max_model_len: int
    cost_model: dict[str, Any] = field(default_factory=dict)
    decisions: list[Any] = field(default_factory=list)

    @property
    def requests_per_wall_s(self) -> float:
        """Simulation speed: simulated requests per wall-clock second."""
        return len(self.requests) / self.wall_s if self.wall_s > 0 else float("inf")

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.timeline)


class _Driver:
    """The client side of a cell plus the engine loop; one instance per ``simulate_cell``."""

    def __init__(
        self,
        engine: EngineCore,
        clock: VirtualClock,
        cell: SimCell,
        overhead: float,
        seed: int,
        overhead_cv: float = 0.0,
        way_in_workers: int = 0,
        way_in_s_per_token: float = 0.0,
    ) -> None:
        self.engine, self.clock, self.cell, self.overhead = engine, clock, cell, overhead
        self.seed = seed
        # Lognormal with mean ``overhead``: sigma^2 = ln(1 + cv^2), mu = -sigma^2 / 2.
        self._overhead_sigma = math.sqrt(math.log1p(overhead_cv**2)) if overhead_cv > 0 else 0.0
        self._overhead_rng = random.Random(f"request-overhead|{seed}")
        # When each way-in worker is free again (a min-heap); empty: no queue.
        self._workers: list[float] = [0.0] * way_in_workers
        self._way_in_s_per_token = way_in_s_per_token
        self.vocab = engine.vocab_size or 32000
        self.todo = list(cell.requests)  # not yet sent, in order
        self.todo.reverse()  # pop() from the end = next in order
        self.inbox: list[tuple[float, int, SimRequestResult, SimRequest]] = []  # engine arrivals
        self.live: dict[str, SimRequestResult] = {}
        self.done: list[SimRequestResult] = []
        self.timeline: list[SimStep] = []
        self.in_flight = 0
        self._ids: dict[tuple[str, int], list[int]] = {}
        self._seq = 0

    # -- client ---------------------------------------------------------------------------------
    def _may_send(self, t: float) -> bool:
        d = self.cell.duration_s
        return d is None or t < d

    def send(self, req: SimRequest, t: float, intended: float) -> None:
        rid = f"sim-{req.index}"
        res = SimRequestResult(
            req.index, rid, req.class_name, req.warmup, t, intended, req.prompt_len, req.max_tokens
        )
        self.in_flight += 1
        self._seq += 1
        overhead = self.overhead
        if self._overhead_sigma > 0:
            sigma = self._overhead_sigma
            overhead *= math.exp(self._overhead_rng.gauss(-sigma * sigma / 2, sigma))
        arrival = t + overhead
        if self._workers:
            # The serial part holds the first free worker; the rest of the overhead (client,
            # HTTP) runs before it, overlapped with other requests. Alone: t + overhead.
            service = min(overhead, self._way_in_s_per_token * req.prompt_len)
            start = max(t + overhead - service, heapq.heappop(self._workers))
            arrival = start + service
            heapq.heappush(self._workers, arrival)
        heapq.heappush(self.inbox, (arrival, self._seq, res, req))

    def send_due(self, now: float, on_time: bool = False) -> None:
        """Closed loop: fill free streams; open loop: send arrivals due by ``now``.

        ``on_time``: called at the end of a step before its completions free any slot, so a
        request that arrived during the step found its slot free and went out at its arrival
        time; later calls send the ones that were blocked by the cap at ``now``.
        """
        cap = self.cell.concurrency
        while self.todo:
            nxt = self.todo[-1]
            if cap is not None and self.in_flight >= cap:
                return
            if self.cell.open_loop:
                if nxt.arrival > now or not self._may_send(nxt.arrival):
                    return
                sent = nxt.arrival if on_time else max(now, nxt.arrival)
                self.send(self.todo.pop(), sent, nxt.arrival)
            else:
                if not self._may_send(now):
                    return
                self.send(self.todo.pop(), now, now)

    def next_send_time(self) -> float | None:
        if not self.todo or not self.cell.open_loop:
            return None
        if self.cell.concurrency is not None and self.in_flight >= self.cell.concurrency:
            return None
        nxt = self.todo[-1].arrival
        return nxt if self._may_send(nxt) else None

    # -- engine ---------------------------------------------------------------------------------
    def token_ids(self, req: SimRequest) -> list[int]:
        key = (req.prompt_key or f"#{req.index}", req.prompt_len)
        ids = self._ids.get(key)
        if ids is None:
            rng = random.Random(f"{self.seed}|{key[0]}|{key[1]}")
            ids = [rng.randrange(self.vocab) for _ in range(req.prompt_len)]
            self._ids[key] = ids
        return ids

    def deliver(self, now: float) -> None:
        while self.inbox and self.inbox[0][0] <= now:
            t_engine, _, res, req = heapq.heappop(self.inbox)
            params = SamplingParams(
                max_tokens=req.max_tokens, temperature=0.0, ignore_eos=req.ignore_eos,
                priority=req.priority, traffic_class=req.traffic_class,
            )  # fmt: skip
            try:
                self.engine.add_request(
                    res.request_id, self.token_ids(req), params, arrival_time=res.sent
                )
            except (InvalidRequestError, OverloadedError) as exc:
                code = 400 if isinstance(exc, InvalidRequestError) else 429
                res.error = f"{code}: {exc}"
                res.finished = t_engine
                self.complete(res)
                continue
            self.live[res.request_id] = res

    def complete(self, res: SimRequestResult) -> None:
        self.done.append(res)
        self.in_flight -= 1

    def apply(self, deltas: list[RequestDelta]) -> None:
        for d in deltas:
            if not d.finished:
                continue
            res = self.live.pop(d.request_id, None)
            if res is None or d.times is None:
                continue
            res.token_times = list(d.times.token_times)
            res.first_scheduled = d.times.first_scheduled
            res.finished = d.times.finished
            res.finish_reason = d.finish_reason
            res.num_preemptions = d.num_preemptions
            res.num_prompt_tokens = d.num_prompt_tokens or res.num_prompt_tokens
            if d.error_message:
                res.error = d.error_message
            self.complete(res)

    def record(self, stats: StepStats) -> None:
        self.timeline.append(
            SimStep(
                stats.start_time,
                stats.end_time,
                stats.num_prefill_tokens,
                stats.num_decode_tokens,
                stats.num_running,
                stats.num_waiting,
                stats.kv_cache_usage,
                stats.num_preemptions,
                stats.num_finished,
            )
        )

    def run(self) -> None:
        idle = 0
        while True:
            now = self.clock.now()
            self.send_due(now)
            self.deliver(now)
            if self.engine.has_unfinished_requests():
                deltas, stats = self.engine.step()
                if self.cell.open_loop:
                    self.send_due(self.clock.now(), on_time=True)
                self.apply(deltas)
                if stats is not None:
                    self.record(stats)
                    idle = 0
                    continue
                idle += 1
                if idle < 3:
                    continue  # flush deltas of requests rejected on admission
            wake = [t for t in (self.next_send_time(),) if t is not None]
            if self.inbox:
                wake.append(self.inbox[0][0])
            if not wake:
                if self.engine.has_unfinished_requests():
                    raise RuntimeError("simulator: engine holds requests it never schedules")
                return
            self.clock.advance_to(min(wake))
            idle = 0


def drive(
    engine: EngineCore,
    clock: VirtualClock,
    cell: SimCell,
    *,
    overhead_s: float = 0.0,
    seed: int = 0,
    overhead_cv: float = 0.0,
    way_in_workers: int = 0,
    way_in_s_per_token: float = 0.0,
) -> tuple[list[SimRequestResult], list[SimStep], float]:
    """Run ``cell`` through any engine on ``clock``: the client loop and the engine loop.

    The executor need not be a ``SimExecutor``: with the real runner the clock simply never
    moves, which keeps a closed loop's decisions comparable step for step (the parity test).
    Returns (results by index, timeline, wall seconds).
    """
    driver = _Driver(
        engine, clock, cell, overhead_s, seed, overhead_cv, way_in_workers, way_in_s_per_token
    )
    t0 = time.perf_counter()
    driver.run()
    wall = time.perf_counter() - t0
    return sorted(driver.done, key=lambda r: r.index), driver.timeline, wall


def simulate_cell(
    engine_config: EngineConfig,
    cost_model: CostModel,
    cell: SimCell,
    seed: int = 0,
    *,
    record_decisions: bool = False,
) -> SimResult:
    """Run one cell through ``EngineCore`` + ``SimExecutor`` in virtual time.

    ``seed`` seeds the synthetic prompt token ids (only their identity matters, for prefix
    caching); everything else is deterministic. With ``record_decisions`` the result keeps each
    step's ``StepDecision``.
    """
    clock = VirtualClock(0.0)
    sim = SimExecutor(cost_model, clock, seed=seed)
    executor: Executor = RecordingExecutor(sim) if record_decisions else sim
    num_blocks = cost_model.num_kv_blocks(engine_config)
    engine = EngineCore(
        engine_config,
        executor,
        num_kv_blocks=num_blocks,
        max_model_len=cost_model.max_model_len(engine_config),
        vocab_size=cost_model.vocab_size,
        eos_token_ids=frozenset(cost_model.eos_token_ids),
        clock=clock,
    )
    results, timeline, wall = drive(
        engine,
        clock,
        cell,
        overhead_s=cost_model.request_overhead_s,
        seed=seed,
        overhead_cv=cost_model.request_overhead_cv,
        way_in_workers=cost_model.way_in_workers,
        way_in_s_per_token=cost_model.way_in_s_per_token,
    )
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
        decisions=executor.decisions if isinstance(executor, RecordingExecutor) else [],
    )
