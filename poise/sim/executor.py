"""Executors for virtual time: ``SimExecutor`` and a decision recorder for any executor.

``SimExecutor`` implements the ``Executor`` protocol without a model: for each
``SchedulerOutput`` it asks the cost model how long the step takes, advances the
``VirtualClock`` by that much, and returns one fixed non-EOS token for every request that
samples. Requests therefore end by ``max_tokens`` (ignore_eos semantics); the simulator gives a
request a sampled output length by setting its ``max_tokens``.

``DecisionRecorder`` is an engine observer that logs each step's decisions whatever the
executor (the real ``ModelRunner`` or a ``SimExecutor``), which is how the parity test compares
the two.

With ``cost_model.step_jitter_cv`` > 0 each step's time is multiplied by a lognormal factor of
mean 1 and that coefficient of variation, drawn from ``random.Random(seed)``: a real CPU's
steps of identical shape do not take identical times, and in a closed loop a deterministic
simulator keeps every wave of requests in lockstep, so its TTFT p95 collapses onto its p50.

``slowdown`` (1 by default) divides the engine's share of a core into the step: the cluster
simulator sets it before each step when replicas share a host's cores (``sim/cpu_share.py``).

A row verifying drafts keeps a prefix of them drawn at ``cost_model.spec_acceptance_rate``
(``sim/speculation.py``), from its own seeded stream.

Invariants: the clock only moves forward, by exactly ``cost_model.time_for(output)`` per step
(times the jitter factor when jitter is on; the same factors for the same seed), times ``slowdown``; the token
returned is never an EOS id, so EOS never ends a simulated request.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from poise.core.outputs import ModelRunnerOutput, SchedulerOutput
from poise.engine.clock import VirtualClock
from poise.engine.observer import EngineObserver
from poise.sim.cost import CostModel
from poise.sim.speculation import accepted_drafts


def pick_token_id(eos_token_ids: tuple[int, ...] | frozenset[int], vocab_size: int) -> int:
    """The smallest id that is not an EOS id (what every simulated step 'samples')."""
    for tid in range(max(vocab_size, 1)):
        if tid not in eos_token_ids:
            return tid
    raise ValueError("vocab_size: every token is an EOS token")


class SimExecutor:
    def __init__(
        self,
        cost_model: CostModel,
        clock: VirtualClock,
        token_id: int | None = None,
        seed: int = 0,
    ) -> None:
        self.cost_model = cost_model
        self.clock = clock
        cv = cost_model.step_jitter_cv
        # Lognormal with mean 1: sigma^2 = ln(1 + cv^2), mu = -sigma^2 / 2.
        self._sigma = math.sqrt(math.log1p(cv * cv)) if cv > 0 else 0.0
        self._rng = random.Random(f"step-jitter|{seed}")
        self.token_id = (
            pick_token_id(cost_model.eos_token_ids, cost_model.vocab_size)
            if token_id is None
            else token_id
        )
        self.num_steps = 0
        self.busy_s = 0.0
        self.slowdown = 1.0
        # Speculative decoding: how many drafts each verify keeps (sim/speculation.py).
        self._spec_rng = random.Random(f"spec-accept|{seed}")

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        dt = self.cost_model.time_for(scheduler_output)
        if self._sigma > 0:
            dt *= math.exp(self._rng.gauss(-self._sigma * self._sigma / 2, self._sigma))
        dt *= self.slowdown
        self.clock.advance(dt)
        self.num_steps += 1
        self.busy_s += dt
        tid = self.token_id
        accepted: dict[str, list[int]] = {}
        for sr in scheduler_output.scheduled:
            if sr.sample and sr.num_draft_tokens:
                a = self.cost_model.spec_acceptance_rate
                assert a is not None, "sim_engine refuses speculation without an acceptance rate"
                kept = accepted_drafts(self._spec_rng, a, sr.num_draft_tokens)
                accepted[sr.request_id] = sr.token_ids[len(sr.token_ids) - sr.num_draft_tokens :][
                    :kept
                ]
        return ModelRunnerOutput(
            sampled_token_ids={
                sr.request_id: tid for sr in scheduler_output.scheduled if sr.sample
            },
            accepted_draft_ids=accepted,
        )


@dataclass(frozen=True)
class StepDecision:
    """One step as the scheduler decided it: (request id, start position, tokens) per scheduled
    request in order, and the ids preempted to make room."""

    scheduled: tuple[tuple[str, int, int], ...]
    preempted: tuple[str, ...]

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepDecision:
        return cls(
            tuple((sr.request_id, sr.start_position, len(sr.token_ids)) for sr in out.scheduled),
            tuple(out.preempted_request_ids),
        )


@dataclass
class DecisionRecorder(EngineObserver):
    """Records every executed step's ``StepDecision`` (pass it to ``EngineCore(observers=)``)."""

    decisions: list[StepDecision] = field(default_factory=list)

    def on_step_start(self, output: SchedulerOutput) -> None:
        self.decisions.append(StepDecision.of(output))
