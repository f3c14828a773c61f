"""``EngineState``: a read-only snapshot of the engine for the server (gauges, readiness, logs).

The engine thread takes one after each step (``EngineCore.snapshot``) and publishes it; other
threads read the latest snapshot instead of reaching into the scheduler while it runs.
Counters here are totals since the engine started, so a reader never re-derives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from poise.kv.manager import PrefixCacheStats
from poise.sched.speculation import SpecDecodeStats


@dataclass(frozen=True)
class EngineState:
    num_running: int = 0
    num_waiting: int = 0
    # Fraction of KV blocks referenced by requests (free-but-cached blocks count as free).
    kv_cache_usage: float = 0.0
    # The per-step token budget now (moves with the token-budget controller).
    token_budget: int = 0
    # Prefill tokens per step each paced class may take now (the slo policy's pacing; the
    # whole budget when the cap is lifted or above it). Empty without pacing.
    paced_prefill_tokens: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # Totals since start: preemptions (recompute), and the same per traffic class.
    num_preemptions: int = 0
    preemptions_by_class: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # Prefix cache totals since start (admissions that looked up / hit, their tokens; of the
    # hits, those that waited for another request's running prefill: in-flight sharing) and
    # cached blocks evicted (handed out for something else).
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    prefix_cache_evictions: int = 0
    # Speculative decoding's counters since start (vLLM's spec_decode_*); None when it is off.
    spec_decode: SpecDecodeStats | None = None
    # Whether the waiting queue is at max_num_queued_requests (new requests get 429).
    queue_full: bool = False
