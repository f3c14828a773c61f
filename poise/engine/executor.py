"""The executor seam: anything that turns a SchedulerOutput into sampled tokens."""

from __future__ import annotations

from typing import Protocol

from poise.core.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
