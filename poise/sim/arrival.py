"""The client arrival model: how long a request takes from the client's send to the engine.

A cost model says how long the engine's steps take; this says when each request reaches the
engine. The two are separate because they are calibrated from different evidence (step
traces and step-time profiles vs. the response-header latency of an idle server) and because a
different server (another HTTP front, a tokenizer pool) changes one and not the other.

``ArrivalModel`` (immutable, what the CLI flags set):
- ``request_overhead_s``: time before the engine sees a request (client, HTTP, chat template,
  tokenization); every latency is still measured from the client's send time;
- ``request_overhead_cv``: its spread per request (a seeded lognormal draw of that mean;
  0: every request takes exactly the mean), so requests sent together reach the engine in a
  seeded random order;
- ``way_in_workers``: how many requests the server prepares at once (poise serve renders the
  chat template and tokenizes on one thread); requests then queue for a worker in send order.
  0: no queue, every request is delayed independently;
- ``way_in_s_per_token``: how long one holds a worker, per prompt token (the serial part of the
  overhead; the rest, client and HTTP, overlaps between requests). A burst thus reaches the
  engine one after another in send order, long prompts taking longer.

``WayIn`` is one cell's state of that model (the seeded draws and the workers' queue).

Invariants: an arrival is never before its send time; a request alone (no queue) arrives
exactly ``request_overhead_s`` after it is sent when the spread is 0, whatever the workers;
for a given seed the draws are the same.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArrivalModel:
    """The client side of a request's way in; see the module docstring."""

    request_overhead_s: float = 0.0
    request_overhead_cv: float = 0.0
    way_in_workers: int = 0
    way_in_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        # Negative overheads, spreads or workers would move requests back in time or silently
        # switch the model off.
        for name in (f.name for f in dataclasses.fields(self)):
            if getattr(self, name) < 0:
                raise ValueError(f"arrival model: {name} must be >= 0, got {getattr(self, name)}")

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class WayIn:
    """One cell's arrivals under an ``ArrivalModel``: ``arrival(sent, prompt_len)`` in send
    order gives each request's time at the engine."""

    def __init__(self, model: ArrivalModel, seed: int) -> None:
        self.model = model
        cv = model.request_overhead_cv
        # Lognormal with mean 1: sigma^2 = ln(1 + cv^2), mu = -sigma^2 / 2.
        self._sigma = math.sqrt(math.log1p(cv * cv)) if cv > 0 else 0.0
        self._rng = random.Random(f"request-overhead|{seed}")
        # When each way-in worker is free again (a min-heap); empty: no queue.
        self._workers: list[float] = [0.0] * model.way_in_workers

    def arrival(self, sent: float, prompt_len: int) -> float:
        overhead = self.model.request_overhead_s
        if self._sigma > 0:
            sigma = self._sigma
            overhead *= math.exp(self._rng.gauss(-sigma * sigma / 2, sigma))
        if not self._workers:
            return sent + overhead
        # The serial part holds the first free worker; the rest of the overhead (client,
        # HTTP) runs before it, overlapped with other requests. Alone: sent + overhead.
        service = min(overhead, self.model.way_in_s_per_token * prompt_len)
        start = max(sent + overhead - service, heapq.heappop(self._workers))
        heapq.heappush(self._workers, start + service)
        return start + service
