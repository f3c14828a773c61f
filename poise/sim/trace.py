"""Step traces: one JSON line per engine step, its shape and how long it took.

``poise serve --step-trace FILE`` builds the engine with a ``StepTracer`` observer; every step
then appends its ``StepShape`` (the cost model's inputs) with the wall time and the engine
thread's CPU time of the forward (the same span ``poise profile`` times). ``StepTracer`` takes
any clock, so it can watch an engine on a ``SimExecutor`` and its virtual clock as well. What a trace
answers that the Prometheus histograms cannot:

- is the cost model right on the steps real traffic produced, step for step
  (``predicted_vs_measured``), not only on the profile's grid;
- was the machine slower while a load ran than when it was profiled (the ratio of measured
  to predicted over a window), which on a shared CPU is most of the sim-vs-real gap;
- did the engine thread wait (wall > CPU: descheduled, or blocked on the GIL by the HTTP
  loop) or run slow (CPU time itself inflated: a busy core, a cold cache).

File format: a first line ``{"kind": "poise-step-trace", "version": 1, ...provenance}``,
a line ``{"clock_origin_s": T}`` (where ``start_s`` 0 is on the tracing clock; ``read_trace``
folds it into the header), then one object per step: ``start_s`` (seconds since the trace
opened), ``wall_s``, ``cpu_s`` (absent for simulated traces) and the ``StepShape`` fields.

Invariants: tracing never changes what the executor returns; a step is written after it ran
(a step that raised is not written); lines are flushed as written, so a trace of a server
stopped by SIGTERM is complete up to its last step.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from poise.core.outputs import ModelRunnerOutput, SchedulerOutput
from poise.engine.observer import StepTimer
from poise.sim.cost import CostModel, StepShape

TRACE_KIND = "poise-step-trace"
TRACE_VERSION = 1


@dataclass(frozen=True)
class TracedStep:
    start_s: float
    wall_s: float
    cpu_s: float | None
    shape: StepShape


class StepTraceWriter:
    """Appends trace lines to a file (line-buffered: each step is on disk when written)."""

    def __init__(self, path: str | Path, **provenance: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] | None = open(self.path, "w", buffering=1)  # noqa: SIM115
        self._f.write(json.dumps({"kind": TRACE_KIND, "version": TRACE_VERSION, **provenance}))
        self._f.write("\n")

    def note_origin(self, origin: float) -> None:
        """Record where ``start_s`` 0 is on the tracing clock (a line of its own)."""
        if self._f is not None:
            self._f.write(json.dumps({"clock_origin_s": origin}) + "\n")

    def write(self, start_s: float, wall_s: float, cpu_s: float | None, shape: StepShape) -> None:
        if self._f is None:
            return
        line: dict[str, Any] = {"start_s": round(start_s, 6), "wall_s": round(wall_s, 6)}
        if cpu_s is not None:
            line["cpu_s"] = round(cpu_s, 6)
        line.update(shape.to_dict())
        self._f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class StepTracer(StepTimer):
    """An engine observer that writes each step's shape and duration to ``writer``.

    ``clock`` times the step (wall, or a simulator's virtual clock); ``cpu_clock`` (optional)
    is the calling thread's CPU time: with one torch thread the forward runs on it, so
    wall - CPU is time the engine thread spent not running.
    """

    def __init__(
        self,
        writer: StepTraceWriter,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] | None = time.thread_time,
    ) -> None:
        super().__init__(clock)
        self.writer = writer
        self.cpu_clock = cpu_clock
        self._origin = clock()
        self._cpu_start = 0.0
        # The origin on the clock itself: with the default clock (CLOCK_MONOTONIC, shared by
        # every process on the host) a client's timestamps can be placed on the trace.
        writer.note_origin(self._origin)

    def on_step_start(self, output: SchedulerOutput) -> None:
        if self.cpu_clock is not None:
            self._cpu_start = self.cpu_clock()
        super().on_step_start(output)

    def on_step_end(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        super().on_step_end(output, result)
        cpu = self.cpu_clock() - self._cpu_start if self.cpu_clock is not None else None
        shape = StepShape.from_output(output)
        self.writer.write(self.start - self._origin, self.durations[-1], cpu, shape)


def read_trace(path: str | Path) -> tuple[dict[str, Any], list[TracedStep]]:
    """(header, steps) of a trace file; raises ValueError on a file that is not a trace."""
    lines = Path(path).read_text().splitlines()
    if not lines:
        raise ValueError(f"step trace: {path} is empty")
    header = json.loads(lines[0])
    if header.get("kind") != TRACE_KIND:
        raise ValueError(f"step trace: {path} is not a {TRACE_KIND} file")
    steps = []
    for line in lines[1:]:
        if not line.strip():
            continue
        d = json.loads(line)
        if "clock_origin_s" in d:
            header.setdefault("clock_origin_s", d["clock_origin_s"])
            continue
        steps.append(
            TracedStep(
                start_s=float(d["start_s"]),
                wall_s=float(d["wall_s"]),
                cpu_s=float(d["cpu_s"]) if "cpu_s" in d else None,
                shape=StepShape.from_dict(d),
            )
        )
    return header, steps


def in_window(steps: Iterable[TracedStep], t0: float, t1: float) -> list[TracedStep]:
    """Steps that started in [t0, t1) (trace seconds)."""
    return [s for s in steps if t0 <= s.start_s < t1]


@dataclass(frozen=True)
class TraceComparison:
    """A cost model against traced steps: sums (the time-weighted ratio) and per-step spread."""

    num_steps: int
    measured_s: float  # sum of wall times
    measured_cpu_s: float | None  # sum of CPU times (None for simulated traces)
    predicted_s: float  # sum of the model's step times (no time scale, no jitter)

    @property
    def ratio(self) -> float:
        """Measured / predicted wall time: how much slower the steps ran than modelled."""
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else float("nan")

    @property
    def cpu_ratio(self) -> float | None:
        if self.measured_cpu_s is None or self.predicted_s <= 0:
            return None
        return self.measured_cpu_s / self.predicted_s

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ratio": self.ratio, "cpu_ratio": self.cpu_ratio}


def predicted_vs_measured(model: CostModel, steps: Sequence[TracedStep]) -> TraceComparison:
    """Sum of the model's step times over ``steps`` against the sum measured."""
    cpu = [s.cpu_s for s in steps]
    return TraceComparison(
        num_steps=len(steps),
        measured_s=sum(s.wall_s for s in steps),
        measured_cpu_s=None
        if any(c is None for c in cpu)
        else sum(c for c in cpu if c is not None),
        predicted_s=sum(model.step_time(s.shape) for s in steps),
    )
