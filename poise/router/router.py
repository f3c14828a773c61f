"""The router: class pools, the prefix table, the per-replica account, and its own counters.

``route`` picks a replica and records the request there; the caller then reports what happens
(``on_tokens``, ``on_finish``; ``on_failure`` for a replica that died: it leaves the rotation
and its requests not yet started come back for ``route`` again, ``exclude`` naming where they
failed). ``mark_up`` returns a replica once it answers again.

Class pools (the seed's "give long and short traffic separate pools"): a replica may carry a
pool name; a request goes to its class's pool (``traffic_class``, else ``long`` when the prompt
has at least ``long_prompt_tokens`` tokens, else ``interactive``) plus replicas with no pool.
When every one of those is busy and a replica of another pool is idle, the idle one is lent
(reason suffix ``+spill``); a class whose pool has no healthy replica uses all of them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from poise.kv.block_pool import prefix_keys
from poise.router.account import Decision, InFlight, ReplicaState, RouteRequest
from poise.router.routing_policies import POLICIES, PolicyContext


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "balanced"
    block_size: int = 16  # the replicas' KV block size: the prefix table hashes whole blocks
    prefix_blocks: int = 256  # opening blocks of a prompt the prefix table follows (4096 tokens)
    max_imbalance: int = 8  # prefix_affinity: in-flight requests the affine replica may lead by
    long_prompt_tokens: int = 1024  # pools: a prompt this long is "long" traffic
    table_size: int = 65536  # prefix keys remembered (least recently used dropped)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy: one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("block_size", "prefix_blocks", "long_prompt_tokens", "table_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterConfig.{name}: must be >= 1")


class Router:
    def __init__(self, replicas: Sequence[ReplicaState], config: RouterConfig | None = None):
        if not replicas:
            raise ValueError("router: needs at least one replica")
        self.config = config or RouterConfig()
        self.policy = POLICIES[self.config.policy]
        self.replicas = {r.name: r for r in replicas}
        self.pools = {r.pool for r in replicas if r.pool is not None}
        # prefix key hash -> replicas that computed that block (and so likely still cache it)
        self._table: OrderedDict[int, set[str]] = OrderedDict()
        self._where: dict[str, str] = {}  # request id -> replica
        self._turn = 0
        self.decisions: Counter[str] = Counter()
        self.affinity_lookups = 0
        self.affinity_hits = 0
        self.retries = 0

    # -- placing -------------------------------------------------------------------------------
    def traffic_class(self, req: RouteRequest) -> str | None:
        if not self.pools:
            return None
        if req.traffic_class in self.pools:
            return req.traffic_class
        return "long" if len(req.token_ids) >= self.config.long_prompt_tokens else "interactive"

    def candidates(
        self, req: RouteRequest, exclude: Iterable[str] = ()
    ) -> tuple[list[ReplicaState], set[str]]:
        """Replicas the request may go to, and which of them are lent from another pool."""
        banned = set(exclude)
        healthy = [r for r in self.replicas.values() if r.healthy and r.name not in banned]
        if not healthy:
            raise RuntimeError("router: no healthy replica")
        cls = self.traffic_class(req)
        if cls is None:
            return healthy, set()
        own = [r for r in healthy if r.pool in (cls, None)]
        if not own:
            return healthy, set()
        lent = [r for r in healthy if r not in own and r.load == 0]
        if lent and all(r.load > 0 for r in own):
            return own + lent, {r.name for r in lent}
        return own, set()

    def route(self, req: RouteRequest, exclude: Iterable[str] = ()) -> Decision:
        candidates, lent = self.candidates(req, exclude)
        keys = [
            hash(k)
            for k in prefix_keys(
                req.token_ids[:-1], self.config.block_size, self.config.prefix_blocks
            )
        ]
        # What every candidate holds (a chat template's header, once each served something)
        # tells them apart no more than nothing does.
        floor = min(self._cached_tokens(keys, r.name) for r in candidates)
        ctx = PolicyContext(
            lambda name: self._cached_tokens(keys, name),
            self._turn,
            self.config.max_imbalance,
            floor,
        )
        decision = self.policy(req, candidates, ctx)
        if decision.replica in lent:
            decision = Decision(
                decision.replica, decision.reason + "+spill", decision.cached_tokens
            )
        self._turn += 1
        self.decisions[decision.reason] += 1
        if keys:
            self.affinity_lookups += 1
            self.affinity_hits += decision.cached_tokens > floor
        self._remember(keys, decision.replica)
        self.replicas[decision.replica].inflight[req.request_id] = InFlight(
            len(req.token_ids), req.max_tokens, decision.cached_tokens
        )
        self._where[req.request_id] = decision.replica
        return decision

    def _cached_tokens(self, keys: list[int], name: str) -> int:
        n = 0
        for key in keys:
            if name not in self._table.get(key, ()):
                break
            n += 1
        return n * self.config.block_size

    def _remember(self, keys: list[int], name: str) -> None:
        for key in keys:
            holders = self._table.pop(key, set())
            holders.add(name)
            self._table[key] = holders
        while len(self._table) > self.config.table_size:
            self._table.popitem(last=False)

    # -- what happens next ---------------------------------------------------------------------
    def on_tokens(self, request_id: str, n: int = 1) -> None:
        name = self._where.get(request_id)
        if name is not None and request_id in self.replicas[name].inflight:
            self.replicas[name].inflight[request_id].generated += n

    def on_finish(self, request_id: str) -> None:
        name = self._where.pop(request_id, None)
        if name is not None:
            self.replicas[name].inflight.pop(request_id, None)

    def on_failure(self, name: str) -> list[str]:
        """A replica died: out of rotation, its cache forgotten; returns the ids of its
        requests that had not produced a token (to route again: call ``route`` with
        ``exclude``, which counts a retry)."""
        replica = self.replicas[name]
        replica.healthy = False
        for holders in self._table.values():
            holders.discard(name)
        unstarted = [rid for rid, f in replica.inflight.items() if not f.generated]
        for rid in list(replica.inflight):
            self._where.pop(rid, None)
        replica.inflight.clear()
        return unstarted

    def retry(self, req: RouteRequest, failed: Iterable[str]) -> Decision:
        self.retries += 1
        self.on_finish(req.request_id)
        return self.route(req, exclude=failed)

    def mark_up(self, name: str) -> None:
        self.replicas[name].healthy = True

    def observe_step(self, name: str, num_tokens: int, duration_s: float) -> None:
        """A replica's step (tokens, seconds): its step-cost estimate for ``balanced``."""
        self.replicas[name].est.observe(num_tokens, duration_s)

    @property
    def affinity_hit_rate(self) -> float:
        return self.affinity_hits / self.affinity_lookups if self.affinity_lookups else 0.0
