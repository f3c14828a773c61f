"""The continuous-batching scheduler: who runs in the next forward, with how many tokens.

Pure Python, no torch, no clock: ``now`` is passed in, so the same code drives the real runner
and the simulator. Each step distributes ``max_num_batched_tokens`` in the vLLM framing: every
request has ``num_computed_tokens`` catching up with ``num_tokens``; a decode is a request one
token behind, a prefill (possibly a chunk of it) is one further behind.

One step, as ``schedule`` walks it:

1. Walk: the policy lists the candidates in the order they get budget (``ordering.py``: fifo,
   prefill_first, priority, slo); the step's budget comes from ``Steering`` (fixed, or the
   token-budget controller's), class shares from its ``ShareLedger``.
2. Size: every candidate gets ``_chunk_size`` tokens: what it still lacks, within the budget it
   may use, and at most ``long_prefill_token_threshold`` for a prefill unless the request is
   alone in the engine.
3. Make room (running candidates, ``_make_room``): when one cannot get a KV block, the policy's
   victim among all running requests, the request itself included, is preempted (recompute:
   blocks freed, back to the front of the queue), and no request is admitted for the rest of
   the step: the freed blocks are for the running ones.
4. Admit (waiting candidates, ``_admit``): needs a ``max_num_seqs`` slot (the policy may
   displace a running request for it), token budget, and KV blocks that leave ``safety_margin``
   of the pool free (ignored when nothing runs, so a big prompt cannot block the queue
   forever). It starts after its longest cached prefix (or waits while a running prefill
   computes its next block: ``inflight.py``). The policy says whether one that does not fit
   stops admission behind it.

KV ordering (``kv/manager.py``): blocks for ``[start, start + n)`` are allocated passing
``start``; ``update`` advances ``num_computed_tokens``, then caches blocks.
"""

from __future__ import annotations

from collections import deque
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
from poise.sched.inflight import InflightSharing
from poise.sched.limits import chunk_size, rejection_reason
from poise.sched.ordering import PolicyContext, is_partial_prefill
from poise.sched.policies import StepPlan, build_output, owed_prompt_blocks, prefix_lookup
from poise.sched.predictor import Forecast, prefill_left
from poise.sched.shares import ShareLedger
from poise.sched.siblings import leader_blocks
from poise.sched.speculation import build_speculation, emitted_tokens
from poise.sched.steering import Steering
from poise.sched.stopping import append_until_stop
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
        self.num_preemptions_total = 0
        self._step_id = 0
        # Finishing deltas of requests rejected in add_request, handed out by the next update.
        self._rejected: list[RequestDelta] = []
        self._reserve_blocks = int(config.safety_margin * kv.num_blocks)
        # The long-prefill cap (0: none). It splits prompts, so it needs chunked prefill: without
        # it a capped prompt could never go in whole, and admission stalled behind it for good.
        self._long_prefill_cap = (
            config.long_prefill_token_threshold if config.enable_chunked_prefill else 0
        )
        # Whether decodes were running when the step was scheduled (for the budget controller).
        self._had_decodes = False
        # Policy, classes, step-cost estimate, budget controller, forecasts (sched/steering.py).
        self.steer = Steering(config)
        self.policy = self.steer.policy
        # Speculative decoding (None: off); ``proposer``: the draft model's, for draft_model.
        self.spec = build_speculation(config.speculative_config, proposer, self.steer.estimator)
        self.inflight = InflightSharing(kv, self.requests)  # in-flight prefix sharing

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
        return self.policy.wake(self.running, self.waiting, self.context(now))

    # -- admission forecasts -------------------------------------------------------------------

    def check_admission(self, request: Request, now: float) -> None:
        """Raise OverloadedError when predictive admission refuses this (not yet added) request."""
        self.steer.check_admission(request, self.running, self.waiting, self.context(now))

    def forecast(self, request: Request, now: float) -> Forecast:
        return self.steer.forecast(request, self.running, self.waiting, self.context(now))

    def queue_wait_s(self) -> float:
        """Predicted seconds until the waiting queue's head is admitted (for Retry-After)."""
        return self.steer.queue_wait_s(self.running, self.waiting)

    # -- scheduling -------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Decide the next step: which requests run, from which position, with which tokens.

        Follows the module docstring: walk the policy's candidates, size each with
        ``_chunk_size``, ``_make_room`` for running ones (preempting if needed), ``_admit``
        waiting ones. On return every scheduled request holds the KV blocks for its new tokens;
        its ``num_computed_tokens`` moves only in ``update`` (admission sets it to the cached
        prefix). ``now`` stamps the step start and first-scheduled times.
        """
        self._step_id += 1
        self._had_decodes = any(not is_partial_prefill(r) for r in self.running)
        plan = StepPlan(budget=self.steer.step_budget(self.running, self.waiting, now))
        ctx = self.context(now)
        if self.spec is not None:
            self.spec.begin_step(self.running, self.waiting, plan.budget, self.config.max_num_seqs)
        # The policy's walk; the loop below is the same for every policy.
        candidates = self.policy.walk(self.running, self.waiting, ctx)
        ledger = self.steer.ledger(candidates, self.running, self._long_prefill_cap)
        was_running = {r.request_id for r in self.running}
        admitting = True
        for request in candidates:
            if plan.budget <= 0:
                break
            if request.request_id in was_running:
                # Not preempted earlier in the step, nor run already at a follower's turn.
                if request.status is RequestStatus.RUNNING and not plan.contains(request):
                    self._schedule_running(plan, request, ledger, ctx)
            elif admitting and not plan.made_room:
                admitting = self._admit(plan, request, ledger, ctx, now)
        return build_output(plan, self._step_id, now, self.kv)

    def context(self, now: float) -> PolicyContext:
        return self.steer.context(now, prefix_lookup(self.kv))

    def _chunk_size(self, remaining: int, budget: int) -> int:
        """Tokens a request ``remaining`` tokens behind takes out of ``budget`` now (limits.py)."""
        alone = len(self.running) + len(self.waiting) <= 1
        return chunk_size(remaining, budget, self._long_prefill_cap, alone)

    def _schedule_running(
        self, plan: StepPlan, request: Request, ledger: ShareLedger, ctx: PolicyContext
    ) -> None:
        cls = request.slo.class_name
        prefill = is_partial_prefill(request)
        budget = ledger.token_allowance(cls, plan.budget) if prefill else plan.budget
        n = self._chunk_size(request.num_tokens - request.num_computed_tokens, budget)
        if n <= 0:
            ledger.passed(cls, prefill_left(request))
            return
        spec = self.spec
        if n == 1 and spec is not None and spec.schedule(request, plan, self.kv, self.max_len):
            return  # a decode verifying drafts, its blocks allocated (never by preempting)
        if not self._make_room(request, n, plan, ctx):
            return
        plan.add(request, n)
        if prefill:
            ledger.took_prefill(cls, n)
            plan.owed_blocks = None  # it took some of the blocks it owed: count again

    def _make_room(self, request: Request, n: int, plan: StepPlan, ctx: PolicyContext) -> bool:
        """Get KV blocks for a running request's next ``n`` tokens, preempting the policy's
        victims among all running requests (itself included; one already in this step gives
        its tokens back) until they fit. False when the request had to preempt itself."""
        rid, start = request.request_id, request.num_computed_tokens
        while self.kv.allocate_slots(rid, num_computed_tokens=start, num_new_tokens=n) is None:
            victim = self.policy.victim(self.running, request, ctx)
            self._preempt(victim, plan)
            plan.made_room = True
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Recompute preemption: free the blocks, forget progress, back to the queue's front."""
        plan.remove(request)  # a request displaced after it was scheduled gives its tokens back
        plan.owed_blocks = None  # it may have owed blocks: count again
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.steer.preemptions_by_class[request.slo.class_name] += 1
        self.waiting.appendleft(request)
        plan.preempted_ids.append(request.request_id)

    def _admit(
        self,
        plan: StepPlan,
        request: Request,
        ledger: ShareLedger,
        ctx: PolicyContext,
        now: float,
    ) -> bool:
        """Try to admit one waiting request (its ``num_computed_tokens`` is 0: new, or reset by
        a preemption); False when admission must stop behind it."""
        cls = request.slo.class_name
        free = self.config.max_num_seqs - len(self.running)
        victim = None
        if free <= 0:
            victim = self.policy.displace(request, self.running, ctx)
            if victim is None:
                ledger.left_waiting(cls)
                return not self.policy.blocks_queue(request, ctx)
            free = 1
        shared, leader = leader_blocks(request, self.requests, self.kv), None
        if shared == []:  # no n > 1 leader: a running prefill it may follow (sched/inflight.py)
            shared, leader = self.inflight.lookup(request)
        if not ledger.slot_allowed(cls, free) or shared is None or leader is not None:
            ledger.left_waiting(cls)
            if leader is not None:  # a follower: its class's demand is not this step's ...
                ledger.passed(cls, min(prefill_left(request), self._long_prefill_cap or 1 << 62))
                if not plan.contains(leader):  # ... and its turn runs the leader
                    self._schedule_running(plan, leader, ledger, ctx)
            return True
        cached = shared
        start = len(cached) * self.kv.block_size  # the cached prefix counts as computed
        remaining = request.num_tokens - start
        n = self._chunk_size(remaining, ledger.token_allowance(cls, plan.budget))
        # Without chunked prefill a prompt goes in whole; recomputes after preemption may
        # still be chunked, or a preempted request longer than the budget could never return.
        whole_only = not self.config.enable_chunked_prefill and not request.num_preemptions
        if n <= 0 or (whole_only and n < remaining):
            # Only reserved budget left, or whole-only it fits the step but not the reservations.
            ledger.left_waiting(cls)
            ledger.passed(cls, remaining if n > 0 else 0)
            return n <= 0 or remaining <= plan.budget or not self.policy.blocks_queue(request, ctx)
        if victim is not None:  # only now that this surely goes in (else two displace each other)
            self._preempt(victim, plan)
        # Blocks that must stay free: the safety margin, and under a policy that reserves
        # prompts what the running prefills and this one's own prompt still need.
        reserve = owed = 0
        if self.running:
            reserve = self._reserve_blocks
            if self.policy.reserves_prompts:
                if plan.owed_blocks is None:
                    plan.owed_blocks = owed_prompt_blocks(self.running, self.kv)
                owed = self.kv.blocks_for(request.num_tokens) - self.kv.blocks_for(start + n)
                reserve += plan.owed_blocks + owed
        if self.kv.allocate_slots(
            request.request_id, num_computed_tokens=start, num_new_tokens=n,
            cached_blocks=cached, reserve_blocks=reserve,
        ) is None:  # fmt: skip
            ledger.left_waiting(cls)
            ledger.passed(cls, remaining)
            return not self.policy.blocks_queue(request, ctx)
        self.waiting.remove(request)
        request.num_computed_tokens = start
        request.num_cached_tokens = start
        request.status = RequestStatus.RUNNING
        if request.times.first_scheduled is None:
            request.times.first_scheduled = now
        self.running.append(request)
        plan.add(request, n, cached_tokens=start)
        self.inflight.admitted(request, cached)  # counts the lookup, registers its prefill
        ledger.admitted(cls)
        ledger.took_prefill(cls, n)
        if plan.owed_blocks is not None:
            plan.owed_blocks += owed
        return True

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
                self.steer.first_token(request, now)
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
        budget = self.steer.budget  # the one this step was scheduled under
        self.steer.observe_step(output.total_num_scheduled_tokens, output.schedule_time, now,
                                self._had_decodes, bool(self.running or self.waiting))  # fmt: skip
        finished = sum(1 for d in deltas if d.finished)
        stats = StepStats.of(output, now, running=len(self.running), waiting=len(self.waiting),
                             kv_cache_usage=self.kv.usage, finished=finished, budget=budget)  # fmt: skip
        return deltas, stats
