"""Replicas that share a machine's cores with what relays their traffic (``SharedCpu``).

A cost profile says what a step costs an engine thread that has a core to itself (``poise
profile --clock cpu``). When N replicas run on one host of C cores, together with the HTTP
proxy, the router, the replicas' event loops and the client, each busy engine thread gets

    share = min(1, (C - relay) / busy)        relay = background + requests/s x per-request
                                                      + tokens/s x per-token  (in cores)

of a core (the kernel's fair scheduler gives the relay's short bursts what they ask and the
busy engine threads the rest, evenly), and a step takes its profiled time over that share.
``busy`` counts the replicas that have work at the step's start; the rates are the host's
over the last ``window_s`` of virtual time. The terms are measured, never fitted to a result:
the background from an idle server, the relay per request and per token from the CPU time
the server's threads and the client spend outside the engines over a concurrency-1 cell
(``poise.lab.cpu_accounting``; ``fit_relay`` here).

Without a ``SharedCpu`` every replica has its own device (the H100 fleet): shares are 1.

Stdlib only.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# The least share an engine thread is modelled to get. Past saturation (relay demand at the
# core count) the fair scheduler still gives every runnable thread its turn; a floor keeps the
# model finite there rather than claiming the engines stop.
MIN_SHARE = 0.1


@dataclass(frozen=True)
class SharedCpu:
    cores: float
    background_cores: float = 0.0  # the idle server's own CPU (health checks, controllers)
    relay_s_per_request: float = 0.0  # CPU seconds outside the engines per request
    relay_s_per_token: float = 0.0  # ... and per output token streamed
    window_s: float = 1.0

    def __post_init__(self) -> None:
        if self.cores <= 0:
            raise ValueError(f"cores: must be > 0, got {self.cores}")
        if min(self.background_cores, self.relay_s_per_request, self.relay_s_per_token) < 0:
            raise ValueError("SharedCpu: background and relay costs must be >= 0")
        if self.window_s <= 0:
            raise ValueError(f"window_s: must be > 0, got {self.window_s}")

    def relay_cores(self, requests_per_s: float, tokens_per_s: float) -> float:
        return (
            self.background_cores
            + requests_per_s * self.relay_s_per_request
            + tokens_per_s * self.relay_s_per_token
        )

    def engine_share(self, busy: int, requests_per_s: float, tokens_per_s: float) -> float:
        """The share of a core each of ``busy`` engine threads gets (1: a core of its own)."""
        if busy <= 0:
            return 1.0
        free = self.cores - self.relay_cores(requests_per_s, tokens_per_s)
        return max(MIN_SHARE, min(1.0, free / busy))

    def describe(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class RateWindow:
    """Events per second over the last ``window_s`` (virtual time, non-decreasing)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, t: float, n: float = 1.0) -> None:
        self._events.append((t, n))
        self._sum += n

    def rate(self, now: float) -> float:
        while self._events and self._events[0][0] <= now - self.window_s:
            self._sum -= self._events.popleft()[1]
        return max(0.0, self._sum) / self.window_s


def fit_relay(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(per-request, per-token) CPU seconds from ``(output tokens, relay CPU s)`` per request:
    least squares, each term clamped at 0 (all of it per token when the requests' lengths do
    not differ, or per request when a negative slope says the lengths explain nothing)."""
    if not samples:
        raise ValueError("fit_relay: no requests")
    xs = [float(n) for n, _ in samples]
    ys = [c for _, c in samples]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, (my / mx if mx > 0 else 0.0)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    if slope <= 0:
        return my, 0.0
    intercept = my - slope * mx
    if intercept < 0:  # through the origin
        return 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return intercept, slope
