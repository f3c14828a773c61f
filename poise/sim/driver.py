"""The client loop and the engine loop of one simulated cell, on a virtual clock.

Client model (mirrors ``poise bench``):
- closed loop (``concurrency`` N): N requests are sent at t=0; each time one finishes, the next
  is sent at that (virtual) instant;
- open loop: request i is sent at ``requests[i].arrival``; with ``concurrency`` set it is a cap,
  and a request due while N are in flight is sent when a slot frees (``intended`` keeps the
  scheduled time).
A request reaches the engine when the client arrival model says (``poise.sim.arrival``: the
request overhead, its spread, the server's way-in workers); every latency is measured from the
send time, as the client does.

Invariants: deterministic for a given (engine, cell, arrival model, seed): no wall clock in the
simulated times, no unseeded randomness; the engine code is not modified or subclassed.
"""

from __future__ import annotations

import heapq
import random
import time

from poise.core.outputs import RequestDelta, StepStats
from poise.core.sampling_params import SamplingParams
from poise.engine.clock import VirtualClock
from poise.engine.core import EngineCore
from poise.errors import InvalidRequestError, OverloadedError
from poise.sim.arrival import ArrivalModel, WayIn
from poise.sim.cell import SimCell, SimRequest, SimRequestResult, SimStep


class _Driver:
    """The client side of a cell plus the engine loop; one instance per ``simulate_cell``."""

    def __init__(
        self, engine: EngineCore, clock: VirtualClock, cell: SimCell, way_in: WayIn, seed: int
    ) -> None:
        self.engine, self.clock, self.cell, self.way_in = engine, clock, cell, way_in
        self.seed = seed
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
        arrival = self.way_in.arrival(t, req.prompt_len)
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
        if req.token_ids is not None:
            return list(req.token_ids)
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
            self.submit(self.engine, res, req, self.token_ids(req), t_engine)

    def submit(
        self,
        engine: EngineCore,
        res: SimRequestResult,
        req: SimRequest,
        ids: list[int],
        t_engine: float,
    ) -> bool:
        """Add ``req`` to ``engine`` as the bench client sends it (greedy, its priority and
        class); a refusal is the client's 400 / 429 and completes it at ``t_engine``. Returns
        whether the engine took it."""
        params = SamplingParams(
            max_tokens=req.max_tokens,
            temperature=0.0,
            ignore_eos=req.ignore_eos,
            priority=req.priority,
            traffic_class=req.traffic_class,
        )
        try:
            engine.add_request(res.request_id, ids, params, arrival_time=res.sent)
        except (InvalidRequestError, OverloadedError) as exc:
            code = 400 if isinstance(exc, InvalidRequestError) else 429
            res.error = f"{code}: {exc}"
            res.finished = t_engine
            self.complete(res)
            return False
        self.live[res.request_id] = res
        return True

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
            res.num_cached_tokens = d.num_cached_tokens
            res.num_prompt_tokens = d.num_prompt_tokens or res.num_prompt_tokens
            if d.error_message:
                res.error = d.error_message
            self.complete(res)

    def record(self, stats: StepStats) -> None:
        self.timeline.append(stats)

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
            wake = [t for t in (self.next_send_time(), self.engine.wake_time()) if t is not None]
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
    arrival: ArrivalModel = ArrivalModel(),
    seed: int = 0,
) -> tuple[list[SimRequestResult], list[SimStep], float]:
    """Run ``cell`` through any engine on ``clock``: the client loop and the engine loop.

    The executor need not be a ``SimExecutor``: with the real runner the clock simply never
    moves, which keeps a closed loop's decisions comparable step for step (the parity test).
    Returns (results by index, timeline, wall seconds).
    """
    driver = _Driver(engine, clock, cell, WayIn(arrival, seed), seed)
    t0 = time.perf_counter()
    driver.run()
    wall = time.perf_counter() - t0
    return sorted(driver.done, key=lambda r: r.index), driver.timeline, wall
