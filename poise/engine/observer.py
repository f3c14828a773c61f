"""Observers: code that watches engine steps (tracing, timing, recording), composed when the
engine is built instead of wrapped around its executor.

``EngineCore(..., observers=[...])`` calls, for every step that reaches the executor, on the
engine's thread and in the order the observers were given::

    on_step_start(output)            scheduled, about to execute
    on_step_end(output, result)      the executor returned (before the results are applied)
    on_step_failed(output, error)    the executor, or applying its result, raised

An observer must not change the output or the result; an exception it raises fails the step
like one from the executor. Subclass ``EngineObserver`` and override the hooks you need.
"""

from __future__ import annotations

from collections.abc import Callable

from poise.core.outputs import ModelRunnerOutput, SchedulerOutput


class EngineObserver:
    """No-op hooks; see the module docstring for when each is called."""

    def on_step_start(self, output: SchedulerOutput) -> None:
        return None

    def on_step_end(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        return None

    def on_step_failed(self, output: SchedulerOutput, error: BaseException) -> None:
        return None


class StepTimer(EngineObserver):
    """Times each step's execution (``on_step_start`` to ``on_step_end``) with ``tick``.

    ``tick`` is injected (``time.perf_counter``, ``time.thread_time``, a virtual clock's
    ``now``), so the engine package reads no clock of its own. ``durations`` has one entry per
    step that executed; ``start`` is when the last step started, on ``tick``.
    """

    def __init__(self, tick: Callable[[], float]) -> None:
        self.tick = tick
        self.start = 0.0
        self.durations: list[float] = []

    def on_step_start(self, output: SchedulerOutput) -> None:
        self.start = self.tick()

    def on_step_end(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        self.durations.append(self.tick() - self.start)
