"""Predicted time to first token, from the work queued ahead and the measured step cost.

A small fluid replay of the steps to come, with step durations from the online
``StepCostEstimator``: each step the running decodes take one token each, the rest of the
budget goes to prefill, the request's class getting its share of it while other classes also
have prefill work (all of it otherwise, and what it leaves goes to them); requests of its class
ordered before it are prefilled first, in order, each once it holds a sequence slot; a request
whose prefill ends becomes a decode for the rest of its ``max_tokens``, and a decode that
reaches its ``max_tokens`` frees its slot. The request's first token comes in the step that
ends its own prefill. New arrivals are not foreseen; an early stop (EOS) finishes a request
sooner than assumed, so the forecast errs late.

The same replay gives the overload answer: a request that would miss its TTFT target by more
than the admission margin is refused with ``Retry-After`` = the first step boundary at which a
request like it, arriving then, would meet the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poise.core.request import Request
from poise.sched.estimator import StepCost
from poise.sched.ordering import Policy, is_partial_prefill
from poise.sched.view import PolicyView

# A replay longer than this many steps means "far beyond any target": stop counting.
MAX_STEPS = 20_000


@dataclass(frozen=True)
class Backlog:
    """What stands between a new request and its first token."""

    budget: int  # this step's token budget
    max_num_seqs: int
    share: float  # the class's share of the prefill budget (1.0 when it has no classes)
    decodes: Sequence[int]  # output tokens left per running decode
    # (prefill tokens left, output tokens to generate, holds a slot) per request of its class
    # ordered before it
    ahead: Sequence[tuple[int, int, bool]]
    own_tokens: int  # its own prompt tokens left (after the prefix cache)
    other_prefill: int  # prompt tokens other classes have queued (they run alongside)
    # Pacing (the slo policy, pacing.py): prefill tokens a paced class takes per step (0: no
    # pacing), and whether the request's own class / the other classes are paced.
    pace_tokens: int = 0
    own_paced: bool = False
    others_paced: bool = False


@dataclass(frozen=True)
class Forecast:
    ttft_s: float  # predicted TTFT, counted from arrival
    step_s: float  # predicted duration of one busy step


class _Replay:
    def __init__(self, est: StepCost, b: Backlog) -> None:
        self.est, self.b = est, b
        self.t = 0.0
        self.steps = 0
        self.decodes = list(b.decodes)
        self.queue = [list(q) for q in b.ahead]  # [left, out, slot(0/1)]
        self.other = b.other_prefill
        self.running = len(self.decodes) + sum(1 for q in self.queue if q[2])

    def copy(self) -> _Replay:
        c = _Replay.__new__(_Replay)
        c.est, c.b, c.t, c.steps = self.est, self.b, self.t, self.steps
        c.decodes, c.queue = list(self.decodes), [list(q) for q in self.queue]
        c.other, c.running = self.other, self.running
        return c

    def step(self) -> None:
        num_decodes = len(self.decodes)
        room = max(1, self.b.budget - num_decodes)
        mine = room if self.other <= 0 else max(1, int(self.b.share * room), room - self.other)
        cap = self.b.pace_tokens
        if cap and self.b.own_paced:
            mine = min(mine, cap)
        used = 0
        for q in self.queue:
            if not q[2]:
                if self.running >= self.b.max_num_seqs:
                    break
                q[2] = 1
                self.running += 1
            take = min(q[0], mine - used)
            if take <= 0:
                break
            q[0] -= take
            used += take
        other = min(self.other, room - used)
        if cap and self.b.others_paced:
            other = min(other, cap)
        self.other -= other
        self.t += self.est.step_time(num_decodes + used + other)
        self.steps += 1
        self.decodes = [d - 1 for d in self.decodes if d > 1]
        self.running -= num_decodes - len(self.decodes)
        for q in [q for q in self.queue if q[0] <= 0]:
            self.queue.remove(q)
            if q[1] > 1:
                self.decodes.append(q[1] - 1)
            else:
                self.running -= 1

    def ttft(self, own_tokens: int) -> float:
        """From this state: when a request appended to the queue now samples its first token."""
        r = self.copy()
        r.queue.append(mark := [own_tokens, 2, 0])
        start = r.t
        while mark in r.queue and r.steps - self.steps < MAX_STEPS:
            r.step()
        return r.t - start if mark not in r.queue else float("inf")


def forecast(est: StepCost, backlog: Backlog, waited_s: float = 0.0) -> Forecast:
    replay = _Replay(est, backlog)
    ttft = replay.ttft(backlog.own_tokens)
    busy = min(
        backlog.budget,
        len(backlog.decodes)
        + backlog.own_tokens
        + backlog.other_prefill
        + sum(q[0] for q in backlog.ahead),
    )
    return Forecast(ttft_s=waited_s + ttft, step_s=est.step_time(busy))


def retry_after(est: StepCost, backlog: Backlog, target_s: float) -> float:
    """Seconds until a request like this one, arriving then, would meet ``target_s``."""
    replay = _Replay(est, backlog)
    states = [replay.copy()]
    while replay.queue or replay.other > 0 or replay.decodes:
        if replay.steps >= MAX_STEPS:
            break
        replay.step()
        states.append(replay.copy())
    # The backlog only drains (nothing new arrives in the replay): bisect on the step.
    lo, hi = 0, len(states) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if states[mid].ttft(backlog.own_tokens) <= target_s:
            hi = mid
        else:
            lo = mid + 1
    return max(states[lo].t, est.step_time(backlog.budget))


def refusal(
    est: StepCost, backlog: Backlog, fc: Forecast, target_s: float | None, margin: float
) -> float | None:
    """None to admit; else the Retry-After (s) of a request that would miss its target by more
    than ``margin`` (a fraction of the target)."""
    if target_s is None or fc.ttft_s <= target_s * (1.0 + margin):
        return None
    return retry_after(est, backlog, target_s)


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
    ctx: PolicyView,
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
    cls = request.slo.class_name
    by_class = len(shares) > 1

    def same(r: Request) -> bool:
        return not by_class or r.slo.class_name == cls

    def out_left(r: Request) -> int:
        return max(1, r.sampling_params.max_tokens - r.num_output_tokens)

    partial = [r for r in running if is_partial_prefill(r)]
    queue = [(prefill_left(r), out_left(r), True) for r in partial if same(r)]
    queue += [(prefill_left(r), out_left(r), False) for r in ahead if same(r)]
    return Backlog(
        budget=budget,
        max_num_seqs=max_num_seqs,
        share=shares.get(cls, 1.0) if by_class else 1.0,
        decodes=[out_left(r) for r in running if not is_partial_prefill(r)],
        ahead=queue,
        own_tokens=prefill_left(request, ctx.cached_tokens(request)),
        other_prefill=sum(prefill_left(r) for r in [*partial, *waiting] if not same(r)),
    )
