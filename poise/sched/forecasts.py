"""Forecasts at arrival: predicted TTFT, predictive admission and every ``Retry-After``.

``Forecaster`` replays the backlog a request would join (``predictor.py``) at the step cost
admission believes in: the online fit, slowed by what the steps did lately and by how late
first tokens came against such forecasts (``slowdown.py``). Under
``admission_control="predictive"`` a request that would miss its TTFT target is refused at
arrival (``check``); the step loop never sees it. Pure Python and clock-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from poise.config import SchedulerConfig
from poise.core.request import Request
from poise.errors import OverloadedError
from poise.sched.estimator import StepCostEstimator
from poise.sched.ordering import Policy, is_partial_prefill
from poise.sched.pacing import Pacing
from poise.sched.predictor import Backlog, Forecast, backlog_for, forecast, prefill_left, refusal
from poise.sched.slowdown import NEAR_TARGET, ForecastTail, Slowdown, SlowedCost
from poise.sched.view import PolicyView


class Forecaster:
    def __init__(
        self,
        config: SchedulerConfig,
        policy: Policy,
        shares: Mapping[str, float],
        pacing: Pacing | None,
        estimator: StepCostEstimator,
    ) -> None:
        self.config = config
        self.policy = policy
        self.shares = dict(shares)
        self.pacing = pacing
        self.estimator = estimator
        self.predictive = config.admission_control == "predictive"
        self.slowdown = Slowdown()  # how much slower than the fit the steps were, lately
        # ... and how much later than the forecasts first tokens came, lately; under
        # predictive admission at least 1 + margin: admission aims at the target and keeps the
        # margin for the forecast's error (sched/slowdown.py)
        self.tail = ForecastTail(floor=1.0 + config.admission_margin if self.predictive else 1.0)

    def observe_step(self, num_tokens: int, start: float, end: float, busy_after: bool) -> None:
        """A step of ``num_tokens`` (0: it computed nothing); ``busy_after``: it left work."""
        if num_tokens <= 0:
            self.slowdown.idle()
        else:
            self.slowdown.observe(num_tokens, start, end, busy_after)

    def first_token(self, request: Request, now: float) -> None:
        """``request`` sampled its first token at ``now``: how late against its admission."""
        if request.admission_forecast is not None:
            admitted, replay_s = request.admission_forecast
            self.tail.observe(now - admitted, replay_s)
            request.admission_forecast = None

    def admission_cost(self) -> SlowedCost:
        """The step cost admission forecasts with: the fit at the recent slowdown, times how
        late first tokens lately came against such forecasts."""
        factor = self.slowdown.factor(self.estimator) * self.tail.factor()
        return SlowedCost(self.estimator, factor)

    def backlog(
        self,
        request: Request,
        running: Sequence[Request],
        waiting: Sequence[Request],
        view: PolicyView,
    ) -> Backlog:
        budget, max_seqs = view.budget, self.config.max_num_seqs
        backlog = backlog_for(
            request, running, waiting, self.policy, view, self.shares, budget, max_seqs
        )
        if self.pacing is None:
            return backlog
        others = {c for c in self.shares if c != request.slo.class_name}
        return replace(
            backlog,
            pace_tokens=self.pacing.tokens(self.estimator),
            own_paced=request.slo.class_name in self.pacing.paced,
            others_paced=bool(others) and others <= self.pacing.paced,
        )

    def forecast(
        self,
        request: Request,
        running: Sequence[Request],
        waiting: Sequence[Request],
        view: PolicyView,
    ) -> Forecast:
        backlog = self.backlog(request, running, waiting, view)
        return forecast(self.estimator, backlog, max(0.0, view.now - request.arrival_time))

    def check(
        self,
        request: Request,
        running: Sequence[Request],
        waiting: Sequence[Request],
        view: PolicyView,
    ) -> None:
        """Raise OverloadedError (with the forecast's Retry-After) under predictive admission."""
        if not self.predictive:
            return
        backlog = self.backlog(request, running, waiting, view)
        # The slowed cost (sched/slowdown.py), for the forecast and its Retry-After alike: a
        # request retried then meets the target at the same slowdown.
        cost = self.admission_cost()
        waited = max(0.0, view.now - request.arrival_time)
        fc = forecast(cost, backlog, waited)
        target = request.slo.ttft_s
        wait = refusal(cost, backlog, fc, target, self.config.admission_margin)
        if wait is None:
            if target is not None and fc.ttft_s >= NEAR_TARGET * target:
                # What the first token is judged against: the forecast without the tail
                # factor (the replay's time is linear in the step cost), else the factor
                # would learn its own correction and swing.
                replay_s = (fc.ttft_s - waited) / self.tail.factor()
                request.admission_forecast = (view.now, replay_s)
            return
        steps = self.slowdown.factor(self.estimator)  # what the steps did (not the tail's part)
        slow = f" (steps {steps:.2f}x the fit lately)" if steps > 1 else ""
        raise OverloadedError(
            f"predicted time to first token {fc.ttft_s:.2f} s{slow} misses the "
            f"{request.slo.class_name!r} target of {target:.2f} s; retry in {wait:.1f} s",
            retry_after_s=wait,
            reason="slo",
        )

    def queue_wait_s(
        self, running: Sequence[Request], waiting: Sequence[Request], budget: int
    ) -> float:
        """Predicted seconds until the head of the waiting queue is admitted (Retry-After of a
        request refused because the queue is at its bound)."""
        cost = self.admission_cost()
        if not waiting:
            return cost.step_time(budget)
        head = waiting[0]
        backlog = Backlog(
            budget=budget,
            max_num_seqs=self.config.max_num_seqs,
            share=1.0,
            decodes=[
                max(1, r.sampling_params.max_tokens - r.num_output_tokens)
                for r in running
                if not is_partial_prefill(r)
            ],
            ahead=[(prefill_left(r), 1, True) for r in running if is_partial_prefill(r)],
            own_tokens=prefill_left(head),
            other_prefill=0,
        )
        return forecast(cost, backlog).ttft_s
