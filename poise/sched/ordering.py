"""Scheduling policies: one walk order, one waiting-queue key and one victim choice each.

Admission's step loop (``admission.py``) is the same for every policy: it walks the candidates
the policy lists (running requests get their next chunk or decode, waiting ones are admitted),
and when a request needs blocks that are not there it preempts the victim the policy picks. A
policy is a ``Policy`` value made of those functions, not a branch in the loop:

- ``fifo`` (decode-first): running requests in admission order, then the waiting queue in
  arrival order; a waiting request that does not fit stops admission (arrival order is kept);
  the victim is the last admitted.
- ``prefill_first``: unfinished chunked prefills, then the waiting queue, then decodes.
- ``priority`` (vLLM's): the waiting queue by priority (lower first), then arrival; the victim
  is the lowest priority, latest arrival; a waiting request may displace a running one of
  lower priority at the sequence cap. Aging: waiting ``priority_aging_s`` counts as one level,
  so the key is ``arrival + priority x aging`` (a virtual arrival time: the order between two
  requests never changes while they wait, and a request of priority p is passed only by
  requests that arrived less than ``(p - p') x aging`` after it, which bounds its wait).
- ``lpm`` (cache-aware, SGLang's longest-prefix match): running requests first, then the
  waiting queue by the longest cached prefix (then arrival), so a request whose prefix is in
  the cache runs before the blocks are evicted by others; a request waiting longer than
  ``priority_aging_s`` goes first, in arrival order, so no prefix starves.
- ``static`` and ``dynamic`` (teaching and comparison modes, not for serving): batching without
  the continuous part. ``static`` admits only when nothing runs; the batch is what one step can
  admit (``max_num_seqs``, the token budget, KV blocks) and it runs to completion, so every
  request waits for the longest output in front of it. ``dynamic`` is the same, but an idle
  engine waits for the batch to fill (``max_num_seqs`` requests, or the token budget in prompt
  tokens) or for its oldest request to have waited ``max_batch_delay_ms``, whichever comes
  first (``wake`` says when, so a caller can sleep instead of spinning).
- ``slo``: decodes first, then unfinished prefills and waiting requests together by slack:
  ``deadline - now - predicted prefill time``, with ``deadline = arrival + TTFT target +
  priority x aging`` (slack falls a second per second for every request alike, so the order is
  earliest-deadline-first corrected by the work left: no request starves). Slack is compared
  in steps (a one-step difference is a tie), ties go to the longest cached prefix (SGLang's
  longest-prefix match: the cache hit is used before it is evicted), then arrival. Victims are
  chosen by cost: lowest priority, then most slack left after the recompute (in steps), then
  least work lost;
  requests already preempted ``preemption_thrash_limit`` times are spared while others exist.
  With traffic classes, steps are paced for the tightest TTFT target (``pacing.py``): prefills
  of looser classes take only what keeps a step within 15 % of that target. Paced, a long
  prompt holds its KV blocks for many steps while it grows chunk by chunk, so admission counts
  the blocks every running prefill still needs for the rest of its prompt as taken, and admits
  a request only when the rest of its own prompt fits too: otherwise several long prompts
  admitted side by side outgrow the pool together and preempt one another (measured on the CPU,
  closed loop at c=32, long ratio 0.25: 28 preemptions in 128 requests, mostly half-prefilled
  long prompts, and short requests queued behind a full pool).

``priority`` and ``slo`` do not block the queue behind a request that does not fit: a smaller
one further back may go, unless the blocked one is overdue (past its deadline, or waiting
longer than one aging period), in which case admission stops so that room gathers for it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from poise.config import SCHEDULING_POLICIES
from poise.core.request import Request
from poise.sched.view import PolicyView

# The names the config accepts: one list, in config.py.
POLICIES: tuple[str, ...] = SCHEDULING_POLICIES

# Waiting requests the lpm policy orders by cached prefix each step (SGLang: 128).
LPM_LOOKAHEAD = 128


def is_partial_prefill(request: Request) -> bool:
    """More than one token behind: a chunked prefill (or a recompute) is still in progress."""
    return not request.is_decoding


def priority_key(request: Request, ctx: PolicyView) -> tuple[float, float]:
    if ctx.params.aging_s > 0:
        return (request.arrival_time + request.priority * ctx.params.aging_s, request.arrival_time)
    return (float(request.priority), request.arrival_time)


def deadline(request: Request, ctx: PolicyView) -> float:
    target = request.slo.ttft_s if request.slo.ttft_s is not None else ctx.params.default_ttft_s
    return request.arrival_time + target + request.priority * ctx.params.aging_s


def slack(request: Request, ctx: PolicyView, cached: int = 0) -> float:
    """Seconds to spare before its TTFT deadline, after the prefill it still needs
    (``cached``: prompt tokens the prefix cache would spare it)."""
    if request.times.first_token is not None and not is_partial_prefill(request):
        return math.inf  # its TTFT is behind it
    left = request.num_tokens - max(request.num_computed_tokens, cached)
    return deadline(request, ctx) - ctx.now - ctx.prefill_time(left)


def _bucket(s: float, ctx: PolicyView) -> float:
    return math.floor(s / ctx.step_s) if ctx.step_s > 0 and math.isfinite(s) else s


def slo_coarse_key(request: Request, ctx: PolicyView) -> tuple[float, float]:
    """Slack in steps, then arrival: the order without prefix lookups."""
    return (_bucket(slack(request, ctx), ctx), request.arrival_time)


def slo_key(request: Request, ctx: PolicyView) -> tuple[float, int, float]:
    """The full order: slack in steps, then the longest cached prefix, then arrival."""
    cached = ctx.cached_tokens(request)
    return (_bucket(slack(request, ctx, cached), ctx), -cached, request.arrival_time)


def is_overdue(request: Request, ctx: PolicyView) -> bool:
    """Waited so long that requests behind it must not take the room it needs."""
    return slack(request, ctx) < 0 or (
        ctx.params.aging_s > 0 and ctx.now - request.arrival_time > ctx.params.aging_s
    )


# -- walks: the candidates of one step, in the order they get budget -------------------------

Walk = Callable[[Sequence[Request], Sequence[Request], PolicyView], list[Request]]


def walk_fifo(
    running: Sequence[Request], waiting: Sequence[Request], _: PolicyView
) -> list[Request]:
    return [*running, *waiting]


def walk_prefill_first(
    running: Sequence[Request], waiting: Sequence[Request], _: PolicyView
) -> list[Request]:
    partial = [r for r in running if is_partial_prefill(r)]
    decodes = [r for r in running if not is_partial_prefill(r)]
    return [*partial, *waiting, *decodes]


def walk_priority(
    running: Sequence[Request], waiting: Sequence[Request], ctx: PolicyView
) -> list[Request]:
    return [*running, *sorted(waiting, key=lambda r: priority_key(r, ctx))]


def walk_slo(
    running: Sequence[Request], waiting: Sequence[Request], ctx: PolicyView
) -> list[Request]:
    decodes = [r for r in running if not is_partial_prefill(r)]
    prefills = [r for r in running if is_partial_prefill(r)] + list(waiting)
    # A prefix lookup per request per step is what a long queue would cost: order everyone
    # by slack without it (conservative: a cache hit only adds slack), then refine the head
    # that this step can reach with the full key (cache hits, ties to the longest prefix).
    prefills.sort(key=lambda r: slo_coarse_key(r, ctx))
    head = prefills[: ctx.params.lookahead]
    head.sort(key=lambda r: slo_key(r, ctx))
    return [*decodes, *head, *prefills[ctx.params.lookahead :]]


def walk_lpm(
    running: Sequence[Request], waiting: Sequence[Request], ctx: PolicyView
) -> list[Request]:
    # Prefix lookups (a hash per prompt block) only for the queue's head, arrival order beyond
    # it; at least SGLang's 128, since a hit far back is what this policy is for.
    queue, n = list(waiting), max(ctx.params.lookahead, LPM_LOOKAHEAD)
    head, rest = queue[:n], queue[n:]

    def key(r: Request) -> tuple[bool, float, float]:
        overdue = ctx.params.aging_s > 0 and ctx.now - r.arrival_time > ctx.params.aging_s
        return (not overdue, 0.0 if overdue else -ctx.cached_tokens(r), r.arrival_time)

    return [*running, *sorted(head, key=key), *rest]


def walk_static(
    running: Sequence[Request], waiting: Sequence[Request], _: PolicyView
) -> list[Request]:
    """A running batch finishes before anyone is admitted: the waiting queue only when idle."""
    return list(running) if running else list(waiting)


def dynamic_batch_ready(waiting: Sequence[Request], ctx: PolicyView) -> bool:
    """An idle engine's dynamic batch goes now: it is full, or its oldest waited long enough."""
    if not waiting:
        return False
    full = len(waiting) >= ctx.params.max_num_seqs or (
        sum(r.num_tokens for r in waiting) >= ctx.budget
    )
    return full or ctx.now >= dynamic_deadline(waiting, ctx)


def dynamic_deadline(waiting: Sequence[Request], ctx: PolicyView) -> float:
    return min(r.arrival_time for r in waiting) + ctx.params.batch_delay_s


def walk_dynamic(
    running: Sequence[Request], waiting: Sequence[Request], ctx: PolicyView
) -> list[Request]:
    if running:
        return list(running)
    return list(waiting) if dynamic_batch_ready(waiting, ctx) else []


def wake_dynamic(
    running: Sequence[Request], waiting: Sequence[Request], ctx: PolicyView
) -> float | None:
    """When an idle engine holding a dynamic batch back will start it without new input."""
    if running or not waiting:
        return None
    return ctx.now if dynamic_batch_ready(waiting, ctx) else dynamic_deadline(waiting, ctx)


# -- victims: who loses its blocks when a request cannot grow ---------------------------------

# ``candidates``: the running requests in admission order, ``current`` (the one that needs
# blocks) among them; the victim may be ``current`` itself, or one already in this step.
Victim = Callable[[Sequence[Request], Request, PolicyView], Request]


def victim_last_admitted(candidates: Sequence[Request], current: Request, _: PolicyView) -> Request:
    """The last admitted, which may be ``current``: a request never preempts one admitted
    before it, so the longest-running request keeps its blocks. (``prefill_first`` walks
    prefills and admissions before decodes. When a prefill chose among the others not yet in
    the step, it preempted an older decode, whose blocks admitted a waiting request, and three
    requests preempted each other for ever; when an older decode could not take the blocks of
    a request admitted earlier in its step, two recomputes preempted each other for ever. Both
    found by tests/unit/test_core_stateful.py's large run.)"""
    return candidates[-1]


def _worst(candidates: Sequence[Request], key: Callable[[Request], tuple[float, ...]]) -> Request:
    """The candidate with the largest ``key``, ties to the last admitted (as above: with the
    virtual clock's equal arrival times, ties to the first preempted the oldest for ever)."""
    return max(enumerate(candidates), key=lambda ir: (*key(ir[1]), ir[0]))[1]


def victim_lowest_priority(
    candidates: Sequence[Request], current: Request, ctx: PolicyView
) -> Request:
    return _worst(candidates, lambda r: priority_key(r, ctx))


def victim_cost_aware(candidates: Sequence[Request], current: Request, ctx: PolicyView) -> Request:
    spared = [r for r in candidates if r.num_preemptions < ctx.params.preemption_thrash_limit]
    pool = spared or candidates

    def cost(r: Request) -> tuple[float, float, int]:
        # Higher is a better victim: lowest priority (largest key), then the most slack it
        # would have after losing its blocks (the whole recompute ahead of it; a request past
        # its first token has no TTFT to miss), in steps, then the least work to recompute.
        if r.times.first_token is not None:
            after = math.inf
        else:
            left = deadline(r, ctx) - ctx.now - ctx.prefill_time(r.num_tokens)
            after = math.floor(left / ctx.step_s) if ctx.step_s > 0 else left
        return (priority_key(r, ctx)[0], after, -r.num_computed_tokens)

    return _worst(pool, cost)


def displace_lower_priority(
    request: Request, running: Sequence[Request], ctx: PolicyView
) -> Request | None:
    """At the sequence cap, the running request ``request`` may take the place of, if any: one
    of a strictly lower priority level that the aged order also puts behind it (never an
    equal: preempting equals only shuffles work)."""
    lower = [r for r in running if r.priority > request.priority]
    if not lower:
        return None
    worst = max(lower, key=lambda r: priority_key(r, ctx))
    return worst if priority_key(worst, ctx) > priority_key(request, ctx) else None


def never_displace(request: Request, running: Sequence[Request], ctx: PolicyView) -> None:
    return None


def always_block(request: Request, ctx: PolicyView) -> bool:
    return True


@dataclass(frozen=True)
class Policy:
    name: str
    walk: Walk
    victim: Victim
    # Whether a waiting request that cannot be admitted stops admission behind it.
    blocks_queue: Callable[[Request, PolicyView], bool]
    # A running request the waiting one may preempt to take its place, or None.
    displace: Callable[[Request, Sequence[Request], PolicyView], Request | None]
    # Sort key of the waiting queue (None: the queue's own order), for predictions.
    waiting_key: Callable[[Request, PolicyView], object] | None
    # When a step that schedules nothing although requests wait will schedule them without new
    # input (None: only new input changes it): a caller sleeps until then instead of spinning.
    wake: Callable[[Sequence[Request], Sequence[Request], PolicyView], float | None] | None = None
    # Whether steps are kept short for the tightest TTFT target (``pacing.py``).
    paces: bool = False
    # Whether admission keeps free the KV blocks every admitted prompt still needs (see the
    # module docstring): prompts prefilled in small chunks do not outgrow the pool together.
    reserves_prompts: bool = False


_REGISTRY: dict[str, Policy] = {
    "fifo": Policy("fifo", walk_fifo, victim_last_admitted, always_block, never_displace, None),
    "prefill_first": Policy(
        "prefill_first",
        walk_prefill_first,
        victim_last_admitted,
        always_block,
        never_displace,
        None,
    ),
    "priority": Policy(
        "priority",
        walk_priority,
        victim_lowest_priority,
        is_overdue,
        displace_lower_priority,
        priority_key,
    ),
    "slo": Policy(
        "slo",
        walk_slo,
        victim_cost_aware,
        is_overdue,
        displace_lower_priority,
        slo_coarse_key,
        paces=True,
        reserves_prompts=True,
    ),
    "lpm": Policy("lpm", walk_lpm, victim_last_admitted, always_block, never_displace, None),
    "static": Policy(
        "static", walk_static, victim_last_admitted, always_block, never_displace, None
    ),
    "dynamic": Policy(
        "dynamic",
        walk_dynamic,
        victim_last_admitted,
        always_block,
        never_displace,
        None,
        wake_dynamic,
    ),
}


def get_policy(name: str) -> Policy:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"scheduling_policy: must be one of {POLICIES}, got {name!r}") from None


def prefill_queue(
    policy: Policy,
    running: Sequence[Request],
    waiting: Sequence[Request],
    view: PolicyView,
    only: Collection[str] | None = None,
) -> list[Request]:
    """The unfinished prefills and the waiting queue's head (the policy's lookahead), in the
    policy's order: who is next to need prefill budget (of the classes ``only``). Filtering
    before the sort keeps the relative order of the whole queue's: the sort is by key, stable."""
    prefills = [r for r in running if is_partial_prefill(r)]
    queue = [*prefills, *itertools.islice(waiting, view.params.lookahead)]
    if only is not None:
        queue = [r for r in queue if r.slo.class_name in only]
    if policy.waiting_key is not None:
        key = policy.waiting_key
        queue.sort(key=lambda r: key(r, view))  # type: ignore[arg-type,return-value]
    return queue
