"""What a policy may know: ``PolicyParams`` (fixed for the engine's life) and ``PolicyView``
(one moment: the time, the step's token budget and cost, the prefix cache).

Pure Python and clock-free: ``now`` comes in from the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from poise.config import SchedulerConfig
from poise.core.request import Request
from poise.kv.manager import KVCacheManager
from poise.sched.classes import ClassSet
from poise.sched.estimator import StepCostEstimator

# TTFT target of requests without one, when no class names any (the slo policy's deadline).
FALLBACK_TTFT_S = 10.0


@dataclass(frozen=True)
class PolicyParams:
    # Seconds of waiting worth one priority level (0: strict priority, no aging).
    aging_s: float = 0.0
    # TTFT target for requests without one (seconds).
    default_ttft_s: float = FALLBACK_TTFT_S
    preemption_thrash_limit: int = 3
    # How many of the first candidates a policy orders with its full (costlier) key.
    lookahead: int = 64
    # What makes a dynamic batch full (with the step's budget), and how long its oldest
    # request may wait for that.
    max_num_seqs: int = 0
    batch_delay_s: float = 0.0

    @classmethod
    def of(cls, config: SchedulerConfig, classes: ClassSet) -> PolicyParams:
        targets = [c.ttft_ms for c in classes.classes if c.ttft_ms is not None]
        return cls(
            aging_s=config.priority_aging_s,
            default_ttft_s=max(targets) / 1000.0 if targets else FALLBACK_TTFT_S,
            preemption_thrash_limit=config.preemption_thrash_limit,
            lookahead=2 * config.max_num_seqs,
            max_num_seqs=config.max_num_seqs,
            batch_delay_s=config.max_batch_delay_ms / 1000.0,
        )


def no_prefix(request: Request) -> int:
    return 0


@dataclass(frozen=True)
class PolicyView:
    now: float
    params: PolicyParams
    budget: int  # the step's token budget
    cost: StepCostEstimator
    # Prompt tokens of the longest cached prefix this request would reuse.
    cached_tokens: Callable[[Request], int] = no_prefix
    # One full step's predicted time: slack differences under it are ties.
    step_s: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_s", self.cost.step_time(self.budget))

    def prefill_time(self, num_tokens: int) -> float:
        """Seconds to compute this many prompt tokens in steps of the budget (the constant
        part is paid once per step)."""
        steps = max(1, -(-num_tokens // max(1, self.budget)))
        return steps * self.cost.const_s + num_tokens * self.cost.per_token_s

    def at(self, budget: int, cached_tokens: Callable[[Request], int] = no_prefix) -> PolicyView:
        return replace(self, budget=budget, cached_tokens=cached_tokens)


def prefix_lookup(kv: KVCacheManager) -> Callable[[Request], int]:
    """A step's ``PolicyView.cached_tokens``: the cached prefix a waiting request would reuse,
    one lookup per request per step."""
    memo: dict[str, int] = {}

    def cached_tokens(request: Request) -> int:
        if request.num_computed_tokens or not kv.enable_prefix_caching:
            return 0
        rid = request.request_id
        if rid not in memo:
            memo[rid] = len(kv.find_cached_prefix(request)) * kv.block_size
        return memo[rid]

    return cached_tokens
