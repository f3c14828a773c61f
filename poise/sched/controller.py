"""The token-budget controller: the per-step budget that keeps decode TPOT at its target.

A step's duration is every running decode's inter-token latency, and it grows with the tokens
in the step. So with decodes running, the budget is set to what a step of the target duration
computes (feed-forward from the online ``StepCostEstimator``), times a correction learned from
the steps that did use their whole budget (what the linear estimate gets wrong on this
machine). The rest of the budget after decodes goes to prefills, so prefills get as much as the
TPOT target allows, and all of ``max_num_batched_tokens`` when nothing decodes. The value moves
between ``min_num_batched_tokens`` and ``max_num_batched_tokens``, every step.

Admission reads the budget through ``StepBudget`` (``gates.py``): ``FixedBudget`` is the
configured one, ``ControlledBudget`` this controller's, given way to TTFT deadlines.
"""

from __future__ import annotations

from collections.abc import Sequence

from poise.core.request import Request
from poise.sched.estimator import StepCostEstimator
from poise.sched.ordering import Policy, is_partial_prefill, prefill_queue
from poise.sched.pacing import deadline_missed
from poise.sched.view import PolicyView

# How much of the measured error one full step corrects (0..1), and the correction's bounds.
GAIN = 0.3
CORRECTION_RANGE = (0.25, 4.0)
# A step counts as full (the budget was the limit) when it used this much of it.
FULL = 0.9


class TokenBudgetController:
    def __init__(
        self,
        estimator: StepCostEstimator,
        target_tpot_s: float,
        floor: int,
        ceiling: int,
    ) -> None:
        if target_tpot_s <= 0:
            raise ValueError(f"target_tpot_ms: must be > 0, got {target_tpot_s * 1000:g}")
        self.estimator = estimator
        self.target_s = target_tpot_s
        self.floor = min(floor, ceiling)
        self.ceiling = ceiling
        self._correction = 1.0
        self.budget = ceiling

    def budget_for_step(self, has_decodes: bool) -> int:
        """The budget of the next step (the gauge shows the last value)."""
        if not has_decodes:
            self.budget = self.ceiling  # no TPOT to protect: prefill at full speed
            return self.budget
        tokens = self.estimator.tokens_for(self.target_s) * self._correction
        self.budget = max(self.floor, min(self.ceiling, int(tokens)))
        return self.budget

    def observe(self, num_tokens: int, duration_s: float, had_decodes: bool, budget: int) -> None:
        """A finished step; only full steps with decodes say whether the target holds."""
        if not had_decodes or duration_s <= 0 or num_tokens < FULL * budget:
            return
        ratio = (self.target_s / duration_s) ** GAIN
        lo, hi = CORRECTION_RANGE
        self._correction = max(lo, min(hi, self._correction * ratio))


class FixedBudget:
    """``max_num_batched_tokens``, every step."""

    def __init__(self, budget: int) -> None:
        self.budget = self.planned = budget

    def for_step(
        self, running: Sequence[Request], waiting: Sequence[Request], view: PolicyView
    ) -> int:
        return self.budget

    def observe(self, num_tokens: int, duration_s: float, had_decodes: bool) -> None:
        return None


class ControlledBudget:
    """The controller's budget, lifted to the ceiling for a step in which a prefill would miss
    its TTFT deadline at it: a TPOT target must not cost another request its TTFT target.
    Without this a closed loop starves long prompts (measured on the CPU at c=32: LONG TTFT
    p95 37 s against a 15 s target, 13 preemptions as they piled up)."""

    def __init__(self, controller: TokenBudgetController, policy: Policy) -> None:
        self.controller = controller
        self.policy = policy
        self.budget = self.planned = controller.ceiling
        self.lifted = False  # this step's budget gave way to a deadline

    def for_step(
        self, running: Sequence[Request], waiting: Sequence[Request], view: PolicyView
    ) -> int:
        num_decodes = sum(1 for r in running if not is_partial_prefill(r))
        self.budget = self.planned = self.controller.budget_for_step(num_decodes > 0)
        self.lifted = False
        ceiling = self.controller.ceiling
        if self.budget < ceiling:
            view = view.at(self.budget)
            queue = prefill_queue(self.policy, running, waiting, view)
            room = max(1, self.budget - num_decodes)
            step_s = self.controller.estimator.step_time(self.budget)
            if deadline_missed(queue, room, step_s, view):
                self.budget, self.lifted = ceiling, True
        return self.budget

    def observe(self, num_tokens: int, duration_s: float, had_decodes: bool) -> None:
        if not self.lifted:  # a lifted step says nothing about the controlled budget
            self.controller.observe(num_tokens, duration_s, had_decodes, self.budget)
