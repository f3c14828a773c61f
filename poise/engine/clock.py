"""Clocks injected into the engine: wall time for serving, virtual time for the simulator.

The scheduler never reads a clock; the engine reads its injected clock once before scheduling
and once after a step's results are in.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    """Seconds from time.monotonic (never jumps backwards)."""

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"dt: cannot move a clock backwards ({dt})")
        self._now += dt

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, t)
