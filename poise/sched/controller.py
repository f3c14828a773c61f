"""The token-budget controller: the per-step budget that keeps decode TPOT at its target.

A step's duration is every running decode's inter-token latency, and it grows with the tokens
in the step. So with decodes running, the budget is set to what a step of the target duration
computes (feed-forward from the online ``StepCostEstimator``), times a correction learned from
the steps that did use their whole budget (what the linear estimate gets wrong on this
machine). The rest of the budget after decodes goes to prefills, so prefills get as much as the
TPOT target allows, and all of ``max_num_batched_tokens`` when nothing decodes. The value moves
between ``min_num_batched_tokens`` and ``max_num_batched_tokens``, every step.
"""

from __future__ import annotations

from poise.sched.estimator import StepCostEstimator

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
