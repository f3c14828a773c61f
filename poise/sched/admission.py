"""Admission: who enters this step with how many tokens, and who is preempted.

``Admission.step`` takes the running and waiting requests and returns the ``StepPlan``: the
admitted chunks, the decodes (with any drafts), the preemptions, and per refused candidate
the reason. Top to bottom:

1. Budgets: the step's token budget (``StepBudget``: fixed, or the TPOT controller's), the
   paced classes' prefill caps (``PrefillCaps``), the class shares' ledger (``ClassLedger``),
   speculation's view of the step (``DraftSource``); interfaces in ``gates.py``.
2. Walk: the policy lists the candidates in the order they get budget (``ordering.py``: fifo,
   prefill_first, priority, slo, ...); the loop is the same for every policy.
3. Size: every candidate gets ``_chunk_size`` tokens: what it still lacks, within the budget it
   may use (less what other classes hold reserved, for a prefill), and at most
   ``long_prefill_token_threshold`` for a prefill unless the request is alone in the engine.
4. Running candidates (``_run``): a decode may verify drafts; when one cannot get a KV block
   (``_make_room``), the policy's victim among all running requests, itself included, is
   preempted (recompute: blocks freed, back to the queue's front), and nothing is admitted for
   the rest of the step: the freed blocks are for the running ones.
5. Waiting candidates (``_admit``), through the gates in order: a ``max_num_seqs`` slot (the
   policy may displace a running request for one), the class's slots, the deferral gates
   (``DeferGate``: a request that must wait although it fits; admission goes on past it),
   token budget, and KV blocks beyond those that must stay free (``BlockReserve``). It starts
   after its longest cached prefix. The policy says whether a request that does not fit stops
   admission behind it.

KV ordering (see ``kv/manager.py``): blocks are allocated for ``[start, start + n)`` passing
``start`` explicitly; the scheduler's ``update`` advances ``num_computed_tokens``, then caches
blocks. Pure Python, no torch, no clock: the simulator runs this code.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from poise.config import SchedulerConfig
from poise.core.request import Request, RequestStatus
from poise.kv.manager import KVCacheManager
from poise.sched.gates import (
    BlockReserve,
    ClassLedger,
    DeferGate,
    DraftSource,
    PrefillCaps,
    StepBudget,
)
from poise.sched.ordering import Policy, is_partial_prefill
from poise.sched.predictor import prefill_left
from poise.sched.shares import ClassShares
from poise.sched.siblings import leader_blocks
from poise.sched.step import (
    CLASS_SLOTS,
    KV_BLOCKS,
    MAKING_ROOM,
    NO_SLOT,
    QUEUE_BLOCKED,
    RESERVED_TOKENS,
    WHOLE_PROMPT,
    StepPlan,
)
from poise.sched.view import PolicyView, prefix_lookup


def long_prefill_cap(config: SchedulerConfig) -> int:
    """The most tokens a prefill chunk takes (0: no cap). It splits prompts, so it needs chunked
    prefill: without it a capped prompt could never go in whole, and admission stalled behind
    it for good."""
    return config.long_prefill_token_threshold if config.enable_chunked_prefill else 0


@dataclass
class _Step:
    """One step's walk: the queues it moves requests between and what it has decided."""

    running: list[Request]
    waiting: deque[Request]
    plan: StepPlan
    ledger: ClassLedger
    view: PolicyView


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        policy: Policy,
        max_len: int,
        requests: Mapping[str, Request],
        *,
        budget: StepBudget,
        caps: PrefillCaps | None,
        shares: ClassShares,
        reserve: BlockReserve,
        defer: Sequence[DeferGate],
        drafts: DraftSource | None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.max_len = max_len
        self.requests = requests  # every live request by id (a sibling's leader)
        self.budget = budget
        self.caps = caps
        self.shares = shares
        self.reserve = reserve
        self.defer = list(defer)
        self.drafts = drafts
        self.long_prefill_cap = long_prefill_cap(config)
        self.preemptions: Counter[str] = Counter()  # by traffic class, since start

    def step(self, running: list[Request], waiting: deque[Request], view: PolicyView) -> StepPlan:
        """Decide the next step. ``view``: now, at the last step's budget, no prefix lookups.

        On return every planned request holds the KV blocks for its new tokens, admitted ones
        are running (``num_computed_tokens`` set to the cached prefix), preempted ones are back
        in ``waiting``."""
        budget = self.budget.for_step(running, waiting, view)
        caps: Mapping[str, int] = {}
        if self.caps is not None:
            caps = self.caps.caps(running, waiting, budget, view.at(self.budget.planned))
        view = view.at(budget, prefix_lookup(self.kv))
        self.reserve.begin_step()
        if self.drafts is not None:
            self.drafts.begin_step(running, waiting, budget, self.config.max_num_seqs)
        candidates = self.policy.walk(running, waiting, view)
        ledger = self.shares.ledger(candidates, running, budget, caps)
        step = _Step(running, waiting, StepPlan(budget=budget), ledger, view)
        was_running = {r.request_id for r in running}
        admitting = True
        for request in candidates:
            if step.plan.budget <= 0:
                break
            if request.request_id in was_running:
                # Not preempted earlier in the step, nor run already at a deferred one's turn.
                if request.status is RequestStatus.RUNNING and not step.plan.contains(request):
                    self._run(step, request)
            elif step.plan.made_room:
                step.plan.refuse(request, MAKING_ROOM)
            elif not admitting:
                step.plan.refuse(request, QUEUE_BLOCKED)
            else:
                admitting = self._admit(step, request)
        return step.plan

    def _chunk_size(self, step: _Step, remaining: int, budget: int) -> int:
        """Tokens a request ``remaining`` tokens behind takes out of ``budget`` now: a prefill
        (more than one token behind) at most the long-prefill cap unless the request is alone
        in the engine, so one long prompt cannot take the whole budget from short ones."""
        n = min(remaining, budget)
        cap = self.long_prefill_cap
        alone = len(step.running) + len(step.waiting) <= 1
        if cap > 0 and remaining > 1 and not alone:
            n = min(n, cap)
        return n

    # -- running requests ---------------------------------------------------------------------

    def _run(self, step: _Step, request: Request) -> None:
        plan, ledger = step.plan, step.ledger
        cls = request.slo.class_name
        prefill = is_partial_prefill(request)
        budget = ledger.token_allowance(cls, plan.budget) if prefill else plan.budget
        n = self._chunk_size(step, request.num_tokens - request.num_computed_tokens, budget)
        if n <= 0:
            ledger.passed(cls, prefill_left(request))
            plan.refuse(request, RESERVED_TOKENS)
            return
        drafts = self.drafts
        if n == 1 and drafts is not None and drafts.schedule(request, plan, self.kv, self.max_len):
            return  # a decode verifying drafts, its blocks allocated (never by preempting)
        if not self._make_room(step, request, n):
            return
        plan.add(request, n)
        if prefill:
            ledger.took_prefill(cls, n)
            self.reserve.recount()  # it took some of the blocks it owed

    def _make_room(self, step: _Step, request: Request, n: int) -> bool:
        """Get KV blocks for a running request's next ``n`` tokens, preempting the policy's
        victims among all running requests (itself included; one already in this step gives
        its tokens back) until they fit. False when the request had to preempt itself."""
        rid, start = request.request_id, request.num_computed_tokens
        while self.kv.allocate_slots(rid, num_computed_tokens=start, num_new_tokens=n) is None:
            victim = self.policy.victim(step.running, request, step.view)
            self._preempt(step, victim)
            step.plan.made_room = True
            if victim is request:
                return False
        return True

    def _preempt(self, step: _Step, request: Request) -> None:
        """Recompute preemption: free the blocks, forget progress, back to the queue's front."""
        step.plan.remove(request)  # one displaced after it was scheduled gives its tokens back
        self.reserve.recount()  # it may have owed blocks
        step.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.preemptions[request.slo.class_name] += 1
        step.waiting.appendleft(request)
        step.plan.preempted_ids.append(request.request_id)

    # -- waiting requests ---------------------------------------------------------------------

    def _admit(self, step: _Step, request: Request) -> bool:
        """Try to admit one waiting request (its ``num_computed_tokens`` is 0: new, or reset by
        a preemption); False when admission must stop behind it."""
        plan, ledger, view = step.plan, step.ledger, step.view
        cls = request.slo.class_name
        free = self.config.max_num_seqs - len(step.running)
        victim = None
        if free <= 0:
            victim = self.policy.displace(request, step.running, view)
            if victim is None:
                return self._refuse(step, request, NO_SLOT, self._blocks(request, view))
            free = 1
        if not ledger.slot_allowed(cls, free):
            return self._refuse(step, request, CLASS_SLOTS, stop=False)
        for gate in self.defer:
            wait = gate.defer(request)
            if wait is not None:
                if wait.run is not None and not plan.contains(wait.run):
                    self._run(step, wait.run)  # what it waits for runs at its turn
                return self._refuse(step, request, wait.reason, stop=False)
        cached = self._cached_prefix(request)
        start = len(cached) * self.kv.block_size  # the cached prefix counts as computed
        remaining = request.num_tokens - start
        # The ledger counted the whole prompt as its class's demand; what the cache holds is
        # demand no longer (else a refused prompt left it reserved, and a budget the size of the
        # reservation refused every prompt of the other classes, step after step).
        counted, needed = prefill_left(request), prefill_left(request, start)
        ledger.passed(cls, self.shares.demand(counted) - self.shares.demand(needed))
        n = self._chunk_size(step, remaining, ledger.token_allowance(cls, plan.budget))
        # Without chunked prefill a prompt goes in whole; recomputes after preemption may
        # still be chunked, or a preempted request longer than the budget could never return.
        whole_only = not self.config.enable_chunked_prefill and not request.num_preemptions
        if n <= 0:  # only budget other classes hold reserved (or its pacing cap) is left
            return self._refuse(step, request, RESERVED_TOKENS, stop=False)
        if whole_only and n < remaining:
            ledger.passed(cls, remaining)
            # Fitting the step but not the reservations it never stops the queue behind it;
            # too big for the step, the policy says.
            stop = remaining > plan.budget and self._blocks(request, view)
            return self._refuse(step, request, WHOLE_PROMPT, stop)
        if victim is not None:  # only now that this surely goes in (else two displace each other)
            self._preempt(step, victim)
        keep = self.reserve.keep_free(request, start, n, step.running)
        blocks = self.kv.allocate_slots(
            request.request_id,
            num_computed_tokens=start,
            num_new_tokens=n,
            cached_blocks=cached,
            reserve_blocks=keep,
        )
        if blocks is None:
            ledger.passed(cls, remaining)
            return self._refuse(step, request, KV_BLOCKS, self._blocks(request, view))
        step.waiting.remove(request)
        request.num_computed_tokens = start
        request.num_cached_tokens = start
        request.status = RequestStatus.RUNNING
        if request.times.first_scheduled is None:
            request.times.first_scheduled = view.now
        step.running.append(request)
        plan.add(request, n, cached_tokens=start)
        for gate in self.defer:  # counts the lookup (in-flight hits), registers its prefill
            gate.admitted(request, cached)
        ledger.admitted(cls)
        ledger.took_prefill(cls, n)
        self.reserve.admitted()
        return True

    def _cached_prefix(self, request: Request) -> list[int]:
        """The blocks it starts after: its leader's prompt (an ``n`` > 1 sibling), else the
        longest cached prefix."""
        return leader_blocks(request, self.requests, self.kv) or self.kv.find_cached_prefix(request)

    def _blocks(self, request: Request, view: PolicyView) -> bool:
        return self.policy.blocks_queue(request, view)

    def _refuse(self, step: _Step, request: Request, reason: str, stop: bool) -> bool:
        """``request`` stays waiting this step (its class's slot demand is gone); False when
        admission stops behind it."""
        step.ledger.left_waiting(request.slo.class_name)
        step.plan.refuse(request, reason)
        return not stop
