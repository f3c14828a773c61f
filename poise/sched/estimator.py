"""An online estimate of the step cost, ``t = a + b x tokens``, from the steps the engine ran.

The scheduler feeds it every step's duration and token count; the TTFT predictor and the token
budget controller read it. It is a least-squares fit over exponentially forgotten sums (recent
steps weigh more, so it follows a machine that speeds up or slows down), started from a prior:
a ``poise profile`` cost model when one is given, else a deliberately rough CPU guess that the
first few dozen steps overwrite. When the steps seen so far all had about the same size, the
slope is not identifiable from them, so the prior's slope is kept and only the intercept fit.

Pure Python and clock-free: durations come in from the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# Rough CPU defaults (the embedded 135M model in bf16 on a few cores): 20 ms per step plus
# 0.15 ms per token. Only a starting point; ``poise profile`` gives real ones.
DEFAULT_CONST_S = 0.02
DEFAULT_PER_TOKEN_S = 1.5e-4
# How much the prior weighs at first (in steps) and how fast it fades (per observed step), and
# how fast old steps are forgotten (per step).
PRIOR_WEIGHT = 4.0
PRIOR_FADE = 0.9
DECAY = 0.995


class StepCost(Protocol):
    """What a forecast needs of a step cost: the duration of a step of so many tokens."""

    def step_time(self, num_tokens: int) -> float: ...


@dataclass
class StepCostEstimator:
    const_s: float = DEFAULT_CONST_S
    per_token_s: float = DEFAULT_PER_TOKEN_S

    def __post_init__(self) -> None:
        self._prior = (self.const_s, self.per_token_s)
        # Weighted sums of 1, n, n^2, t, n*t over the observed steps.
        self._s = [0.0] * 5
        self.num_observed = 0

    @staticmethod
    def _add(s: list[float], n: float, t: float, w: float) -> None:
        s[0] += w
        s[1] += w * n
        s[2] += w * n * n
        s[3] += w * t
        s[4] += w * n * t

    def observe(self, num_tokens: int, duration_s: float) -> None:
        """One finished step: how many tokens it computed and how long it took."""
        if num_tokens <= 0 or duration_s <= 0:
            return
        self._s = [v * DECAY for v in self._s]
        self._add(self._s, float(num_tokens), duration_s, 1.0)
        self.num_observed += 1
        self._solve()

    def _solve(self) -> None:
        # The prior enters as two pseudo-steps that fade as real ones arrive.
        s = list(self._s)
        const, per_token = self._prior
        weight = PRIOR_WEIGHT * PRIOR_FADE**self.num_observed / 2
        for n in (1.0, 512.0):
            self._add(s, n, const + per_token * n, weight)
        w, sn, snn, st, snt = s
        mean_n = sn / w
        var_n = snn / w - mean_n * mean_n
        mean_t = st / w
        # The spread of step sizes must be real (not one size plus the prior's two points) for
        # the slope to mean anything.
        if var_n > 1.0:
            slope = (snt / w - mean_n * mean_t) / var_n
            if slope > 0:
                self.per_token_s = slope
        self.const_s = max(0.0, mean_t - self.per_token_s * mean_n)

    def step_time(self, num_tokens: int) -> float:
        return self.const_s + self.per_token_s * max(0, num_tokens)

    def tokens_for(self, step_time_s: float) -> float:
        """How many tokens a step of this duration computes (inverse of ``step_time``)."""
        return max(0.0, (step_time_s - self.const_s) / self.per_token_s)
