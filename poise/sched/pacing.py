"""Pacing (the ``slo`` policy): steps short enough for the tightest TTFT target.

A request that arrives while a step computes waits for that step to end before its own prefill
can start, whatever the queue order. On the CPU a step that carries a 2,048-token chunk of a
long prompt takes about a second, so in an open loop at 80 % load the short requests' TTFT p95
was 1.4 s against a 1 s target under every queue order (measured, benchmarks/RESULTS.md): the
queue is short there, and only shorter steps help. So under ``slo`` the prefills of classes
whose TTFT target is looser than the tightest one take at most so many tokens per step that
they add ``STEP_FRACTION`` of the tightest target to the step (by the online estimate of a
token's cost): a short arrival then waits at most that long, plus the decodes' part that no
order can shorten, for the step in progress. (A cap on the whole step would fall to the
floor whenever the decodes alone fill it: a closed loop at c=32 here runs ~140 ms decode
steps.) The cap rises, for one step, when a request of a paced class would miss its own TTFT
deadline at the paced rate (as the token-budget controller's budget gives way), so a long
prompt is slowed, never starved; it rises by half at a time to the least cap that meets every
paced deadline, not straight to the whole budget, since a whole-budget step is the ~1 s that a
short arrival then waits (measured, closed loop at c=32 with long prompts queued behind a full
KV pool: runs of lifted 2,048-token steps of 0.9-1.5 s were the short class's TTFT tail). On
hardware where a token costs little against the target
(an H100 computes 2,048 tokens in tens of milliseconds) the cap lies above the budget and
changes nothing.

Pure Python and clock-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from poise.core.request import Request
from poise.sched.classes import ClassSet
from poise.sched.estimator import StepCostEstimator
from poise.sched.ordering import Policy, deadline, is_partial_prefill, prefill_queue
from poise.sched.predictor import prefill_left
from poise.sched.view import PolicyView

# Paced prefill may add this fraction of the tightest TTFT target to a step. A short request's
# TTFT is the rest of the step in progress, its own step (as long again) and its queueing
# behind other short ones. Chosen by measurement (CPU, seed mix, default classes, open loop at
# 80 % of capacity): with 0.25 of the whole step, SHORT TTFT p95 was 0.57 s (0.41x fifo's),
# measured and simulated alike; 0.15 of the prefill part gives 0.46 s (0.31x) simulated.
STEP_FRACTION = 0.15


@dataclass(frozen=True)
class Pacing:
    prefill_s: float  # prefill time a step may carry beside its decodes (the tightest target's)
    paced: frozenset[str]  # classes whose prefills are capped (looser or no TTFT target)
    floor: int  # tokens a paced class may always take per step (progress on slow hardware)

    def tokens(self, estimator: StepCostEstimator) -> int:
        """Prefill tokens a paced class takes per step, at the estimated per-token cost."""
        return max(self.floor, int(self.prefill_s / estimator.per_token_s))

    def caps(self, estimator: StepCostEstimator, num_decodes: int, budget: int) -> dict[str, int]:
        """Prefill tokens each paced class may take this step (empty: nothing to cap)."""
        tokens = self.tokens(estimator)
        if tokens >= budget - num_decodes:
            return {}
        return dict.fromkeys(self.paced, tokens)


def pacing_for(classes: ClassSet, floor: int) -> Pacing | None:
    """The pacing a class set calls for: None unless some class has a tighter TTFT target
    than another (one class, or equal targets: nobody to protect from anybody)."""
    targets = [c.ttft_ms for c in classes.classes if c.ttft_ms is not None]
    if not targets:
        return None
    tight = min(targets)
    paced = frozenset(c.name for c in classes.classes if c.ttft_ms is None or c.ttft_ms > tight)
    if not paced:
        return None
    return Pacing(prefill_s=tight / 1000.0 * STEP_FRACTION, paced=paced, floor=floor)


# Each rise of a cap that would miss a paced deadline multiplies it by this (see above).
LIFT_STEP = 1.5


def lift_cap(
    paced: Sequence[Request],
    cap: int,
    num_decodes: int,
    budget: int,
    estimator: StepCostEstimator,
    ctx: PolicyView,
) -> int | None:
    """The least of ``cap``, ``cap x LIFT_STEP``, ... that lets every paced prefill in
    ``paced`` (in order) meet its TTFT deadline; None when only the whole step would (or not
    even that: then the step is as big as it gets)."""
    room = budget - num_decodes
    while cap < room:
        if not deadline_missed(paced, cap, estimator.step_time(num_decodes + cap), ctx):
            return cap
        cap = int(cap * LIFT_STEP) + 1
    return None


def deadline_missed(queue: Sequence[Request], room: int, step_s: float, ctx: PolicyView) -> bool:
    """Whether a prefill in ``queue`` (in order) misses its TTFT deadline when each finishes
    after the prompt tokens ahead of it and its own, ``room`` tokens per step of ``step_s``."""
    ahead = 0
    for r in queue:
        ahead += prefill_left(r)
        if r.slo.ttft_s is not None and ctx.now + -(-ahead // room) * step_s > deadline(r, ctx):
            return True
    return False


class PacingCaps:
    """Admission's ``PrefillCaps`` (``gates.py``): a step's paced prefill tokens per class."""

    def __init__(self, pacing: Pacing, policy: Policy, estimator: StepCostEstimator) -> None:
        self.pacing = pacing
        self.policy = policy
        self.estimator = estimator
        self.current: dict[str, int] = {}  # this step's caps (empty: no class is held back)

    def caps(
        self,
        running: Sequence[Request],
        waiting: Sequence[Request],
        budget: int,
        view: PolicyView,
    ) -> Mapping[str, int]:
        """The paced classes' cap, risen (``lift_cap``) where a paced prefill would miss its
        deadline; only the paced classes' prefills are ordered, usually none or one."""
        self.current = {}
        num_decodes = sum(1 for r in running if not is_partial_prefill(r))
        caps = self.pacing.caps(self.estimator, num_decodes, budget)
        if caps:
            paced = prefill_queue(self.policy, running, waiting, view, only=caps.keys())
            cap = lift_cap(paced, min(caps.values()), num_decodes, budget, self.estimator, view)
            if cap is not None:
                self.current = dict.fromkeys(caps, cap)
        return self.current

    def gauge(self, budget: int) -> dict[str, int]:
        """Per paced class, the prefill tokens it may take per step now."""
        return {c: self.current.get(c, budget) for c in sorted(self.pacing.paced)}
