"""The continuous-batching scheduler: who runs in the next forward, with how many tokens.

Pure Python, no torch, no clock: ``now`` is passed in, so the same code drives the real runner
and the simulator. Each step distributes ``max_num_batched_tokens`` in the vLLM framing: every
request has ``num_computed_tokens`` catching up with ``num_tokens``; a decode is a request one
token behind, a prefill (possibly a chunk of it) is one further behind.

``schedule`` asks ``Admission`` (``admission.py``) for the step: who enters it with how many
tokens, who is preempted, and why the others wait. This class holds the queues, wires the
concerns admission consults (budget, pacing, class shares, reservations, deferral, drafts;
``gates.py``), forecasts at arrival (``forecasts.py``), and applies each step's results
(``update``). A request's traffic class was resolved once, at arrival, and travels on it
(``request.slo``).

KV ordering (see ``kv/manager.py``): admission allocates blocks for ``[start, start + n)``
passing ``start`` explicitly; ``update`` advances ``num_computed_tokens``, then caches blocks.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence

from poise.config import SchedulerConfig
from poise.core.outputs import (
    ModelRunnerOutput,
    RequestDelta,
    SchedulerOutput,
    StepStats,
    annotate_token_delta,
    finishing_delta,
)
from poise.core.request import Request, RequestStatus
from poise.kv.manager import KVCacheManager
from poise.sched.admission import Admission, long_prefill_cap
from poise.sched.classes import ClassSet, load_classes
from poise.sched.controller import ControlledBudget, FixedBudget, TokenBudgetController
from poise.sched.estimator import DEFAULT_CONST_S, DEFAULT_PER_TOKEN_S, StepCostEstimator
from poise.sched.forecasts import Forecaster
from poise.sched.gates import StepBudget
from poise.sched.inflight import InflightSharing
from poise.sched.limits import rejection_reason
from poise.sched.ordering import get_policy, is_partial_prefill
from poise.sched.pacing import PacingCaps, pacing_for
from poise.sched.predictor import Forecast
from poise.sched.reserve import PromptReserve
from poise.sched.shares import ClassShares
from poise.sched.siblings import LeaderGate
from poise.sched.speculation import build_speculation, emitted_tokens
from poise.sched.step import build_output
from poise.sched.stopping import append_until_stop
from poise.sched.view import PolicyParams, PolicyView, prefix_lookup
from poise.spec.proposer import Proposer


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        # A request may grow to this many tokens: the model's limit, and the whole pool (so a
        # request alone in the engine can always get its next block).
        self.max_len = min(max_model_len, kv.capacity_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._step_id = 0
        # Finishing deltas of requests rejected in add_request, handed out by the next update.
        self._rejected: list[RequestDelta] = []
        # Whether decodes were running when the step was scheduled (for the budget controller).
        self._had_decodes = False
        self.policy = get_policy(config.scheduling_policy)
        self.classes: ClassSet = load_classes(config.traffic_classes)
        self.params = PolicyParams.of(config, self.classes)
        self.estimator = StepCostEstimator(
            config.step_cost_const_s or DEFAULT_CONST_S,
            config.step_cost_per_token_s or DEFAULT_PER_TOKEN_S,
        )
        self.step_budget = self._budget_source()
        # Steps kept short for the tightest TTFT target (the slo policy; None: not paced).
        pacing = pacing_for(self.classes, config.min_num_batched_tokens)
        if not self.policy.paces:
            pacing = None
        self.pacing = None if pacing is None else PacingCaps(pacing, self.policy, self.estimator)
        shares = ClassShares(self.classes, config.max_num_seqs, long_prefill_cap(config))
        # Speculative decoding (None: off); ``proposer``: the draft model's, for draft_model.
        self.spec = build_speculation(config.speculative_config, proposer, self.estimator)
        self.inflight = InflightSharing(kv, self.requests)  # in-flight prefix sharing
        self.admission = Admission(
            config,
            kv,
            self.policy,
            self.max_len,
            self.requests,
            budget=self.step_budget,
            caps=self.pacing,
            shares=shares,
            reserve=PromptReserve(
                kv, int(config.safety_margin * kv.num_blocks), self.policy.reserves_prompts
            ),
            defer=[LeaderGate(self.requests, kv), self.inflight],
            drafts=self.spec,
        )
        self.forecaster = Forecaster(config, self.policy, shares.shares, pacing, self.estimator)
        # Why each candidate the last step reached got nothing (``StepPlan.refused``).
        self.last_refusals: dict[str, str] = {}

    def _budget_source(self) -> StepBudget:
        config = self.config
        if not config.token_budget_controller:
            return FixedBudget(config.max_num_batched_tokens)
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
        controller = TokenBudgetController(
            self.estimator, tpot_s, config.min_num_batched_tokens, config.max_num_batched_tokens
        )
        return ControlledBudget(controller, self.policy)

    # -- queries ----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._rejected)

    def rejection_reason(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of this length can never be served here, or None."""
        return rejection_reason(num_prompt_tokens, self.kv, self.max_len, self.config)

    # -- request lifecycle ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; one that can never fit finishes as rejected on the next update."""
        reason = self.rejection_reason(request.num_prompt_tokens)
        self.requests[request.request_id] = request
        if reason is not None:
            request.error_message = reason
            self._rejected.append(
                self._finish(request, RequestStatus.FINISHED_REJECTED, request.arrival_time)
            )
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, now: float
    ) -> list[RequestDelta]:
        """Abort (or stop) requests now: their blocks are free when this returns."""
        deltas = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            deltas.append(self._finish(request, status, now))
        return deltas

    def _finish(
        self,
        request: Request,
        status: RequestStatus,
        now: float,
        new_token_ids: Sequence[int] = (),
    ) -> RequestDelta:
        """Free the request's blocks and forget it; return its finishing delta."""
        request.status = status
        request.times.finished = now
        self.kv.free(request)
        self.inflight.forget(request.request_id)
        if self.spec is not None:
            self.spec.forget(request.request_id)
        del self.requests[request.request_id]
        return finishing_delta(request, new_token_ids)

    def wake_time(self, now: float) -> float | None:
        """When the policy, holding waiting requests back on purpose (``dynamic``), will start
        them without new input; None when it holds nothing back."""
        if self.policy.wake is None:
            return None
        return self.policy.wake(self.running, self.waiting, self.view(now))

    # -- forecasts at arrival ---------------------------------------------------------------

    def check_admission(self, request: Request, now: float) -> None:
        """Raise OverloadedError when predictive admission refuses this (not yet added) request."""
        self.forecaster.check(request, self.running, self.waiting, self._forecast_view(now))

    def forecast(self, request: Request, now: float) -> Forecast:
        view = self._forecast_view(now)
        return self.forecaster.forecast(request, self.running, self.waiting, view)

    def queue_wait_s(self) -> float:
        """Predicted seconds until the waiting queue's head is admitted (for Retry-After)."""
        return self.forecaster.queue_wait_s(self.running, self.waiting, self.step_budget.budget)

    # -- scheduling -------------------------------------------------------------------------

    @property
    def token_budget(self) -> int:
        """The budget of the step last scheduled (of the next one, before any)."""
        return self.step_budget.budget

    def paced_prefill_tokens(self) -> dict[str, int]:
        """Per paced class, the prefill tokens it may take per step now (for the gauge)."""
        return {} if self.pacing is None else self.pacing.gauge(self.step_budget.budget)

    @property
    def preemptions_by_class(self) -> Counter[str]:
        return self.admission.preemptions

    @property
    def num_preemptions_total(self) -> int:
        return sum(self.admission.preemptions.values())

    def view(self, now: float) -> PolicyView:
        """What a policy knows now, at the last step's budget (no prefix lookups)."""
        return PolicyView(now, self.params, self.step_budget.budget, self.estimator)

    def _forecast_view(self, now: float) -> PolicyView:
        return self.view(now).at(self.step_budget.budget, prefix_lookup(self.kv))

    def schedule(self, now: float) -> SchedulerOutput:
        """Decide the next step (``Admission.step``): which requests run, from which position,
        with which tokens. On return every scheduled request holds the KV blocks for its new
        tokens; its ``num_computed_tokens`` moves only in ``update`` (admission sets it to the
        cached prefix). ``now`` stamps the step start and first-scheduled times."""
        self._step_id += 1
        self._had_decodes = any(not is_partial_prefill(r) for r in self.running)
        plan = self.admission.step(self.running, self.waiting, self.view(now))
        self.last_refusals = plan.refused
        return build_output(plan, self._step_id, now, self.kv)

    # -- applying results ---------------------------------------------------------------------

    def update(
        self, output: SchedulerOutput, result: ModelRunnerOutput, now: float
    ) -> tuple[list[RequestDelta], StepStats]:
        """Apply a step's results: advance progress, append sampled tokens, finish requests.

        For each request of ``output`` still running: ``num_computed_tokens`` advances by the
        tokens it was given, then the KV manager caches its newly full blocks; if it sampled,
        the token is appended and the stop rules decide whether it finishes (its blocks are
        freed at once). ``now`` stamps token and finish times. Returns the step's deltas (the
        finishing deltas of requests rejected since the last update first) and its stats.
        Requests aborted while the step ran are skipped.
        """
        deltas, self._rejected = self._rejected, []
        for sched in output.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            # Drafts are computed only where accepted (below), each after the token before it.
            request.num_computed_tokens += sched.num_tokens - sched.num_draft_tokens
            result.record_prompt_logprobs(request, sched)
            if request.times.first_token is None:
                request.times.prefill_compute += now - output.schedule_time
            if not sched.sample:
                self.kv.cache_full_blocks(request, request.num_computed_tokens)
                continue
            first = request.times.first_token is None
            if first:
                request.times.first_token = now
                self.forecaster.first_token(request, now)
            tokens = emitted_tokens(sched, result, self.spec)
            tokens, status = append_until_stop(request, tokens, now, self.max_len)
            self.kv.cache_full_blocks(request, request.num_computed_tokens)
            if sched.num_draft_tokens:  # roll back the rejected drafts' slots
                self.kv.trim(sched.request_id, request.num_computed_tokens)
            if status is None:
                delta = RequestDelta(sched.request_id, tokens, times=request.times)
            else:
                self.running.remove(request)
                delta = self._finish(request, status, now, tokens)
            deltas.append(annotate_token_delta(delta, request, result, first))
        budget = self.step_budget.budget  # the one this step was scheduled under
        self._observe_step(output.total_num_scheduled_tokens, output.schedule_time, now)
        finished = sum(1 for d in deltas if d.finished)
        stats = StepStats.of(output, now, running=len(self.running), waiting=len(self.waiting),
                             kv_cache_usage=self.kv.usage, finished=finished, budget=budget)  # fmt: skip
        return deltas, stats

    def _observe_step(self, num_tokens: int, start: float, end: float) -> None:
        """A step of ``num_tokens`` (0: it computed nothing) scheduled at ``start``, updated at
        ``end``: the forecasts' slowdown, the step-cost fit and the budget controller learn."""
        busy_after = bool(self.running or self.waiting)
        self.forecaster.observe_step(num_tokens, start, end, busy_after)
        if num_tokens > 0:
            self.estimator.observe(num_tokens, end - start)
            self.step_budget.observe(num_tokens, end - start, self._had_decodes)
