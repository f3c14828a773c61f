"""Routing policies: each a function (request, candidate replicas, context) -> Decision.

- ``round_robin``: in turn, blind to load and cache. The baseline.
- ``least_loaded``: fewest requests in flight, then fewest prompt tokens still to prefill.
- ``prefix_affinity``: the replica already holding the longest run of the prompt's opening KV
  blocks (repeated system prompts, shared documents) beyond what every candidate holds (a
  chat template's header), unless it is more than ``max_imbalance`` requests busier than the
  least loaded one; then, or on a miss (no replica holds more than the others), least
  loaded.
- ``balanced``: the lowest predicted TTFT, from the scheduler's own forecast
  (``sched/predictor.py``) replayed over what the router sent each replica, with the prompt
  tokens a replica is expected to hold already taken off its prefill: cache and load weighed
  in one number of seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from poise.router.account import Decision, ReplicaState, RouteRequest
from poise.sched.predictor import Backlog, forecast


@dataclass
class PolicyContext:
    cached_tokens: Callable[[str], int]  # replica name -> prompt tokens it is expected to hold
    turn: int  # how many requests were routed before this one (round robin)
    max_imbalance: int  # prefix_affinity: how much busier the affine replica may be
    shared_tokens: int = 0  # the prompt's opening every candidate holds: no reason to pick one


Policy = Callable[[RouteRequest, Sequence[ReplicaState], PolicyContext], Decision]


def _least(replicas: Sequence[ReplicaState]) -> ReplicaState:
    return min(replicas, key=lambda r: (r.load, r.queued_prefill))


def round_robin(
    req: RouteRequest, replicas: Sequence[ReplicaState], ctx: PolicyContext
) -> Decision:
    chosen = replicas[ctx.turn % len(replicas)]
    return Decision(chosen.name, "round_robin", ctx.cached_tokens(chosen.name))


def least_loaded(
    req: RouteRequest, replicas: Sequence[ReplicaState], ctx: PolicyContext
) -> Decision:
    chosen = _least(replicas)
    return Decision(chosen.name, "least_loaded", ctx.cached_tokens(chosen.name))


def prefix_affinity(
    req: RouteRequest, replicas: Sequence[ReplicaState], ctx: PolicyContext
) -> Decision:
    cached = {r.name: ctx.cached_tokens(r.name) for r in replicas}
    # Only what one replica holds beyond the others tells them apart: an opening all traffic
    # shares (a chat template's header) is on every replica that served anything, and
    # following it would send everything to whichever replica served first.
    own = {name: max(0, n - ctx.shared_tokens) for name, n in cached.items()}
    best = max(replicas, key=lambda r: (own[r.name], -r.load))
    least = _least(replicas)
    if own[best.name] == 0:
        return Decision(least.name, "affinity_miss", cached[least.name])
    if best.load - least.load > ctx.max_imbalance:
        return Decision(least.name, "affinity_overloaded", cached[least.name])
    return Decision(best.name, "affinity_hit", cached[best.name])


def predicted_ttft(replica: ReplicaState, own_tokens: int) -> float:
    """The replica's TTFT forecast for a request with ``own_tokens`` to prefill."""
    flights = list(replica.inflight.values())
    backlog = Backlog(
        budget=replica.budget,
        max_num_seqs=replica.max_num_seqs,
        share=1.0,
        decodes=[f.decode_left for f in flights if f.generated],
        ahead=[(f.prefill_left, f.decode_left, False) for f in flights if not f.generated],
        own_tokens=max(1, own_tokens),
        other_prefill=0,
    )
    return forecast(replica.est, backlog).ttft_s


def balanced(req: RouteRequest, replicas: Sequence[ReplicaState], ctx: PolicyContext) -> Decision:
    prompt = len(req.token_ids)
    scored = []
    for i, r in enumerate(replicas):
        cached = ctx.cached_tokens(r.name)
        scored.append((predicted_ttft(r, prompt - cached), r.load, i, cached))
    _, _, i, cached = min(scored)
    reason = "balanced_affinity" if cached > ctx.shared_tokens else "balanced"
    return Decision(replicas[i].name, reason, cached)


POLICIES: dict[str, Policy] = {
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "prefix_affinity": prefix_affinity,
    "balanced": balanced,
}
