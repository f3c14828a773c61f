"""What the scheduler knows beyond its queues: policy, classes, step cost, budget, admission.

``Steering`` bundles the per-engine state the policies read (so the scheduler's step loop only
calls it at a few hook points): the selected ``Policy``, the ``ClassSet`` and its shares, the
online ``StepCostEstimator``, the optional ``TokenBudgetController``, the per-step
``PolicyContext`` and ``ShareLedger``, and the TTFT forecast behind predictive admission and
every ``Retry-After``. Pure Python and clock-free: ``now`` comes in from the caller.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

from poise.config import SchedulerConfig
from poise.core.request import Request
from poise.errors import OverloadedError
from poise.sched.classes import ClassSet, load_classes
from poise.sched.controller import TokenBudgetController
from poise.sched.estimator import DEFAULT_CONST_S, DEFAULT_PER_TOKEN_S, StepCostEstimator
from poise.sched.ordering import PolicyContext, get_policy, is_partial_prefill
from poise.sched.pacing import deadline_missed, lift_cap, pacing_for
from poise.sched.predictor import Backlog, Forecast, backlog_for, forecast, prefill_left, refusal
from poise.sched.shares import ShareLedger
from poise.sched.slowdown import NEAR_TARGET, ForecastTail, Slowdown, SlowedCost

# TTFT target of requests without one, when no class names any (the slo policy's deadline).
FALLBACK_TTFT_S = 10.0


class Steering:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.policy = get_policy(config.scheduling_policy)
        self.classes: ClassSet = load_classes(config.traffic_classes)
        self.shares = (
            {c.name: c.share for c in self.classes.classes} if self.classes.has_shares else {}
        )
        self.estimator = StepCostEstimator(
            config.step_cost_const_s or DEFAULT_CONST_S,
            config.step_cost_per_token_s or DEFAULT_PER_TOKEN_S,
        )
        targets = [c.ttft_ms for c in self.classes.classes if c.ttft_ms is not None]
        self.default_ttft_s = max(targets) / 1000.0 if targets else FALLBACK_TTFT_S
        self.controller: TokenBudgetController | None = None
        if config.token_budget_controller:
            tpot_s = (
                config.target_tpot_ms / 1000.0
                if config.target_tpot_ms is not None
                else self.classes.tightest_tpot_s()
            )
            if tpot_s is None:
                raise ValueError(
                    "target_tpot_ms: the token budget controller needs a TPOT target (give "
                    "target_tpot_ms, or traffic classes with tpot_p50_ms)"
                )
            self.controller = TokenBudgetController(
                self.estimator,
                tpot_s,
                config.min_num_batched_tokens,
                config.max_num_batched_tokens,
            )
        self.pacing = (
            pacing_for(self.classes, config.min_num_batched_tokens) if self.policy.paces else None
        )
        self.preemptions_by_class: Counter[str] = Counter()
        self.slowdown = Slowdown()  # admission's forecasts: how much slower than the fit, lately
        # ... and how much later than those forecasts, lately; under predictive admission at
        # least 1 + margin: admission aims at the target and keeps the margin for the
        # forecast's error (sched/slowdown.py)
        predictive = config.admission_control == "predictive"
        self.tail = ForecastTail(floor=1.0 + config.admission_margin if predictive else 1.0)
        self.budget = config.max_num_batched_tokens
        # The controller's budget gave way to a TTFT deadline this step (see ``step_budget``).
        self.lifted = False
        # Prefill tokens per paced class this step (empty: no class is held back).
        self.caps: dict[str, int] = {}

    # -- per step ---------------------------------------------------------------------------

    def context(self, now: float, cached_tokens: Callable[[Request], int]) -> PolicyContext:
        step_s = self.estimator.step_time(self.budget)
        per_token = self.estimator.per_token_s

        def prefill_time(num_tokens: int) -> float:
            # Steps of the full budget; the constant part is paid once per step.
            steps = max(1, -(-num_tokens // max(1, self.budget)))
            return steps * self.estimator.const_s + num_tokens * per_token

        return PolicyContext(
            now=now,
            aging_s=self.config.priority_aging_s,
            prefill_time=prefill_time,
            cached_tokens=cached_tokens,
            step_s=step_s,
            default_ttft_s=self.default_ttft_s,
            preemption_thrash_limit=self.config.preemption_thrash_limit,
            lookahead=2 * self.config.max_num_seqs,
            max_num_seqs=self.config.max_num_seqs,
            token_budget=self.budget,
            batch_delay_s=self.config.max_batch_delay_ms / 1000.0,
        )

    def step_budget(
        self, running: Sequence[Request], waiting: Sequence[Request], now: float
    ) -> int:
        """This step's token budget (the controller's, else the configured one), and the
        pacing caps of the classes with looser TTFT targets (``self.caps``)."""
        self.lifted = False
        self.caps = {}
        if self.controller is None and self.pacing is None:
            return self.budget
        num_decodes = sum(1 for r in running if not is_partial_prefill(r))
        if self.controller is not None:
            self.budget = self.controller.budget_for_step(num_decodes > 0)
        ctx = self.context(now, lambda r: 0)
        queue: list[Request] | None = None
        if self.controller is not None and self.budget < self.controller.ceiling:
            # A TPOT target must not cost another request its TTFT target: a prefill that
            # would miss its deadline at the controlled budget gets the whole step. Without
            # this a closed loop starves long prompts (measured on the CPU at c=32: LONG TTFT
            # p95 37 s against a 15 s target, 13 preemptions as they piled up).
            queue = self._prefill_queue(running, waiting, ctx)
            room = max(1, self.budget - num_decodes)
            if deadline_missed(queue, room, self.estimator.step_time(self.budget), ctx):
                self.budget, self.lifted = self.controller.ceiling, True
        caps = self.pacing.caps(self.estimator, num_decodes, self.budget) if self.pacing else {}
        if caps:
            # The same rule for the pacing cap: it slows a long prompt, never starves it. Only
            # the paced classes' prefills are ordered (the same relative order as in the whole
            # queue: the sort is by key and stable), usually none or one.
            if queue is None:
                queue = self._prefill_queue(running, waiting, ctx, only=caps.keys())
            paced = [r for r in queue if r.slo.class_name in caps]
            cap = lift_cap(paced, min(caps.values()), num_decodes, self.budget, self.estimator, ctx)
            if cap is not None:
                self.caps = dict.fromkeys(caps, cap)
        return self.budget

    def paced_prefill_tokens(self) -> dict[str, int]:
        """Per paced class, the prefill tokens it may take per step now (for the gauge)."""
        if self.pacing is None:
            return {}
        return {c: self.caps.get(c, self.budget) for c in sorted(self.pacing.paced)}

    def _prefill_queue(
        self,
        running: Sequence[Request],
        waiting: Sequence[Request],
        ctx: PolicyContext,
        only: Collection[str] | None = None,
    ) -> list[Request]:
        """The unfinished prefills and the waiting queue's head (the policy's lookahead), in
        the policy's order: who is next to need prefill budget (of the classes ``only``)."""
        prefills = [r for r in running if is_partial_prefill(r)]
        queue = [*prefills, *itertools.islice(waiting, ctx.lookahead)]
        if only is not None:
            queue = [r for r in queue if r.slo.class_name in only]
        if self.policy.waiting_key is not None:
            key = self.policy.waiting_key
            queue.sort(key=lambda r: key(r, ctx))  # type: ignore[arg-type,return-value]
        return queue

    def ledger(
        self, candidates: Sequence[Request], running: Sequence[Request], chunk_cap: int
    ) -> ShareLedger:
        demand: Counter[str] = Counter()
        slots: Counter[str] = Counter()
        running_ids = {r.request_id for r in running}
        for r in candidates:
            cls = r.slo.class_name
            left = prefill_left(r)  # 0 for a decode: decodes are not rationed
            demand[cls] += min(left, chunk_cap) if chunk_cap > 0 else left
            if r.request_id not in running_ids:
                slots[cls] += 1
        by_class = Counter(r.slo.class_name for r in running)
        return ShareLedger(
            self.shares,
            self.budget,
            self.config.max_num_seqs,
            by_class,
            demand,
            slots,
            self.caps,
        )

    def observe_step(
        self, num_tokens: int, start: float, end: float, had_decodes: bool, busy_after: bool
    ) -> None:
        """A step of ``num_tokens`` (0: it computed nothing) scheduled at ``start``, updated at
        ``end``; ``busy_after``: it left requests to serve."""
        if num_tokens <= 0:
            self.slowdown.idle()
            return
        self.slowdown.observe(num_tokens, start, end, busy_after)
        self.estimator.observe(num_tokens, end - start)
        if self.controller is not None and not self.lifted:  # a lifted step says nothing
            self.controller.observe(num_tokens, end - start, had_decodes, self.budget)

    # -- forecasts --------------------------------------------------------------------------

    def backlog(
        self,
        request: Request,
        running: Sequence[Request],
        waiting: Sequence[Request],
        ctx: PolicyContext,
    ) -> Backlog:
        backlog = backlog_for(
            request,
            running,
            waiting,
            self.policy,
            ctx,
            self.shares,
            self.budget,
            self.config.max_num_seqs,
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
        ctx: PolicyContext,
    ) -> Forecast:
        backlog = self.backlog(request, running, waiting, ctx)
        return forecast(self.estimator, backlog, max(0.0, ctx.now - request.arrival_time))

    def check_admission(
        self,
        request: Request,
        running: Sequence[Request],
        waiting: Sequence[Request],
        ctx: PolicyContext,
    ) -> None:
        """Raise OverloadedError (with the forecast's Retry-After) under predictive admission."""
        if self.config.admission_control != "predictive":
            return
        backlog = self.backlog(request, running, waiting, ctx)
        # The slowed cost (sched/slowdown.py), for the forecast and its Retry-After alike: a
        # request retried then meets the target at the same slowdown.
        cost = self.admission_cost()
        waited = max(0.0, ctx.now - request.arrival_time)
        fc = forecast(cost, backlog, waited)
        target = request.slo.ttft_s
        wait = refusal(cost, backlog, fc, target, self.config.admission_margin)
        if wait is None:
            if target is not None and fc.ttft_s >= NEAR_TARGET * target:
                # What the first token is judged against: the forecast without the tail
                # factor (the replay's time is linear in the step cost), else the factor
                # would learn its own correction and swing.
                replay_s = (fc.ttft_s - waited) / self.tail.factor()
                request.admission_forecast = (ctx.now, replay_s)
            return
        steps = self.slowdown.factor(self.estimator)  # what the steps did (not the tail's part)
        slow = f" (steps {steps:.2f}x the fit lately)" if steps > 1 else ""
        raise OverloadedError(
            f"predicted time to first token {fc.ttft_s:.2f} s{slow} misses the "
            f"{request.slo.class_name!r} target of {target:.2f} s; retry in {wait:.1f} s",
            retry_after_s=wait,
            reason="slo",
        )

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

    def queue_wait_s(self, running: Sequence[Request], waiting: Sequence[Request]) -> float:
        """Predicted seconds until the head of the waiting queue is admitted (Retry-After of a
        request refused because the queue is at its bound)."""
        cost = self.admission_cost()
        if not waiting:
            return cost.step_time(self.budget)
        head = waiting[0]
        backlog = Backlog(
            budget=self.budget,
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
