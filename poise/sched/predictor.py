"""Predicted time to first token, from the work queued ahead and the measured step cost.

A new request's first token comes when (1) the prompt tokens ordered before it in its class,
and its own, have been computed and (2) it holds a sequence slot. (1) proceeds at the prefill
tokens its class gets per step: the budget left after the running decodes, times the class's
share while other classes also have prefill work (all of it otherwise). (2) needs, when the
slots are full, as many running requests to finish as there are requests ahead of it without
a slot; each running request is assumed to run to its ``max_tokens`` (one token per step).
Step durations come from the online ``StepCostEstimator``.

The same forecast gives the overload answer: a request that would miss its TTFT target by more
than the admission margin is refused with ``Retry-After`` = the time until the work ahead has
drained enough for it to meet the target (the forecast minus the target, rounded up to a step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from poise.core.request import Request
from poise.sched.estimator import StepCostEstimator
from poise.sched.ordering import Policy, PolicyContext, is_partial_prefill


@dataclass(frozen=True)
class Backlog:
    """What stands between a new request and its first token."""

    budget: int  # this step's token budget
    num_decodes: int  # running requests that take one token per step
    share: float  # the class's share of the prefill budget (1.0 when it is alone)
    prefill_ahead: int  # prompt tokens to compute before its last chunk, its own included
    own_tokens: int  # its own prompt tokens left (after the prefix cache)
    other_prefill: int  # prompt tokens other classes have queued (they run alongside)
    slots_short: int  # running requests that must finish before it gets a slot
    running_left: Sequence[int]  # output tokens left per running request, ascending


@dataclass(frozen=True)
class Forecast:
    ttft_s: float  # predicted TTFT, counted from arrival
    step_s: float  # predicted duration of one busy step


def forecast(est: StepCostEstimator, backlog: Backlog, waited_s: float = 0.0) -> Forecast:
    prefill_room = max(1, backlog.budget - backlog.num_decodes)
    share = backlog.share if backlog.other_prefill > 0 else 1.0
    per_step = max(1.0, share * prefill_room)
    steps = math.ceil(backlog.prefill_ahead / per_step)
    # A busy step carries the decodes plus whatever prefill all classes have, up to the budget.
    work = backlog.prefill_ahead + backlog.other_prefill
    step_tokens = min(backlog.budget, backlog.num_decodes + min(work, prefill_room))
    step_s = est.step_time(step_tokens)
    if backlog.slots_short > 0 and backlog.running_left:
        k = min(backlog.slots_short, len(backlog.running_left)) - 1
        slot_steps = backlog.running_left[k] + math.ceil(backlog.own_tokens / per_step)
        steps = max(steps, slot_steps)
    return Forecast(ttft_s=waited_s + steps * step_s, step_s=step_s)


def retry_after(fc: Forecast, target_s: float) -> float:
    """Seconds until a request refused now would meet ``target_s`` (at least one step)."""
    return max(fc.step_s, fc.ttft_s - target_s + fc.step_s)


def refusal(fc: Forecast, target_s: float | None, margin: float) -> float | None:
    """None to admit; else the Retry-After (s) of a request that would miss its target by more
    than ``margin`` (a fraction of the target)."""
    if target_s is None or fc.ttft_s <= target_s * (1.0 + margin):
        return None
    return retry_after(fc, target_s)


def prefill_left(request: Request, cached_tokens: int = 0) -> int:
    """Prompt (or recompute) tokens this request still has to compute before it samples."""
    if request.num_computed_tokens > 0 and not is_partial_prefill(request):
        return 0  # decoding
    return max(1, request.num_tokens - max(request.num_computed_tokens, cached_tokens))


def backlog_for(
    request: Request,
    running: Sequence[Request],
    waiting: Sequence[Request],
    policy: Policy,
    ctx: PolicyContext,
    shares: dict[str, float],
    budget: int,
    max_num_seqs: int,
) -> Backlog:
    """The backlog a request not yet queued would join (``waiting`` excludes it)."""
    if policy.waiting_key is None:
        ahead = list(waiting)  # a queue: it goes to the back
    else:
        key = policy.waiting_key
        mine = key(request, ctx)
        ahead = [r for r in waiting if key(r, ctx) < mine]  # type: ignore[operator]
    partial = [r for r in running if is_partial_prefill(r)]
    cls = request.slo.class_name
    by_class = len(shares) > 1

    def same(r: Request) -> bool:
        return not by_class or r.slo.class_name == cls

    own = prefill_left(request, ctx.cached_tokens(request))
    mine_ahead = [r for r in [*partial, *ahead] if same(r)]
    others = [r for r in [*partial, *waiting] if not same(r)]
    free_slots = max_num_seqs - len(running)
    waiting_ahead = sum(1 for r in ahead if same(r))
    return Backlog(
        budget=budget,
        num_decodes=sum(1 for r in running if not is_partial_prefill(r)),
        share=shares.get(cls, 1.0) if by_class else 1.0,
        prefill_ahead=own + sum(prefill_left(r) for r in mine_ahead),
        own_tokens=own,
        other_prefill=sum(prefill_left(r) for r in others),
        slots_short=max(0, waiting_ahead + 1 - free_slots),
        running_left=sorted(
            max(1, r.sampling_params.max_tokens - r.num_output_tokens) for r in running
        ),
    )
