"""What the router knows: the request to place and, per replica, what it already sent there.

The router keeps its own account of every request it placed (prompt tokens, output budget,
tokens seen so far) instead of polling the replicas: the account is exact for traffic that goes
through it, costs nothing per decision, and is the same in the simulator and behind Ray Serve.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from poise.sched.estimator import StepCostEstimator


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    token_ids: list[int]  # the prompt as the engine will see it (template applied)
    max_tokens: int
    traffic_class: str | None = None  # a pool name ("long", "interactive"), or None: by length


@dataclass
class InFlight:
    prompt_tokens: int
    max_tokens: int
    cached_tokens: int = 0  # the prefix the router expected the replica to hold already
    generated: int = 0  # output tokens seen; >0 means its prefill is done

    @property
    def prefill_left(self) -> int:
        return 0 if self.generated else max(1, self.prompt_tokens - self.cached_tokens)

    @property
    def decode_left(self) -> int:
        return max(1, self.max_tokens - self.generated)


@dataclass
class ReplicaState:
    name: str
    pool: str | None = None  # None: serves every class
    healthy: bool = True
    # Engine limits the TTFT forecast replays with (the replica's --max-num-batched-tokens,
    # --max-num-seqs) and its step cost.
    budget: int = 2048
    max_num_seqs: int = 256
    est: StepCostEstimator = field(default_factory=StepCostEstimator)
    inflight: dict[str, InFlight] = field(default_factory=dict)

    @property
    def load(self) -> int:
        return len(self.inflight)

    @property
    def queued_prefill(self) -> int:
        return sum(f.prefill_left for f in self.inflight.values())


@dataclass(frozen=True)
class Decision:
    replica: str
    # Why: "round_robin", "least_loaded", "affinity_hit", "affinity_miss",
    # "affinity_overloaded", "balanced", "balanced_affinity"; "+spill" when a pool lent a replica.
    reason: str
    cached_tokens: int = 0  # prefix the chosen replica is expected to hold
