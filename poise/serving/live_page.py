"""The live page's data: one point a second in a ring buffer, from what the metrics observe.

Fed on the engine thread through ``ServingMetrics`` (``add_step`` with each StepStats,
``add_first_token`` with each request's TTFT parts) into running sums under a short lock: a
few additions per step, nothing per token. ``tick`` closes the sums into a point with the
latest EngineState (queue, running, KV, preemptions, prefix cache, speculation) and appends it; the feed
handler calls it at most once a second, so no background task runs when nobody watches.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from poise.core.outputs import StepStats
from poise.core.timing import RequestMetrics
from poise.engine.state import EngineState

TTFT_PARTS = ("ingress", "queue", "prefill_compute", "first_token_sched")


@dataclass
class _Sums:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_requests: int = 0
    decode_requests: int = 0
    budget_use: float = 0.0
    first_tokens: int = 0
    ttft: float = 0.0
    ttft_max: float = 0.0
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TTFT_PARTS, 0.0))


class LiveFeed:
    def __init__(self, capacity: int = 600) -> None:
        self.points: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.seq = 0  # number of points ever appended (a reader's cursor)
        self._lock = threading.Lock()
        self._sums = _Sums()
        self._last_tick: float | None = None
        self._last_preemptions = 0
        # Speculative decoding's (draft tokens, accepted tokens) totals at the last point.
        self._last_spec = (0, 0)
        # Per class: TTFT targets met / missed since start (classes with a target only).
        self._slo: dict[str, list[int]] = {}

    # -- engine thread ---------------------------------------------------------------------

    def add_step(self, stats: StepStats) -> None:
        with self._lock:
            s = self._sums
            s.steps += 1
            s.prefill_tokens += stats.num_prefill_tokens
            s.decode_tokens += stats.num_decode_tokens
            s.prefill_requests += stats.num_prefill_requests
            s.decode_requests += stats.num_decode_requests
            s.budget_use += stats.budget_utilisation

    def add_first_token(self, m: RequestMetrics, cls: str, ttft_target: float | None) -> None:
        if m.ttft is None:
            return
        values = (m.ingress_time, m.queue_time, m.prefill_compute, m.first_token_sched)
        with self._lock:
            s = self._sums
            s.first_tokens += 1
            s.ttft += m.ttft
            s.ttft_max = max(s.ttft_max, m.ttft)
            for name, value in zip(TTFT_PARTS, values, strict=True):
                s.parts[name] += value or 0.0
            if ttft_target is not None:
                met = self._slo.setdefault(cls, [0, 0])
                met[0 if m.ttft <= ttft_target else 1] += 1

    # -- readers ---------------------------------------------------------------------------

    def tick(self, now: float, state: EngineState, min_interval_s: float = 1.0) -> None:
        """Append a point for the time since the last one, if ``min_interval_s`` has passed."""
        with self._lock:
            if self._last_tick is not None and now - self._last_tick < min_interval_s:
                return
            dt = now - self._last_tick if self._last_tick is not None else 0.0
            s, self._sums = self._sums, _Sums()
            self._last_tick = now
            slo = {c: v[0] / (v[0] + v[1]) for c, v in self._slo.items() if v[0] + v[1]}
        steps, firsts = max(s.steps, 1), max(s.first_tokens, 1)
        rate = (lambda n: n / dt) if dt > 0 else (lambda n: 0.0)  # noqa: E731
        preempted = state.num_preemptions - self._last_preemptions
        self._last_preemptions = state.num_preemptions
        point: dict[str, Any] = {
            "t": now,
            "running": state.num_running,
            "waiting": state.num_waiting,
            "kv_usage": state.kv_cache_usage,
            "token_budget": state.token_budget,
            "preemptions": preempted,
            "prefix_cache_hit_rate": (
                state.prefix_cache.hit_tokens / state.prefix_cache.query_tokens
                if state.prefix_cache.query_tokens
                else None
            ),
            "steps_per_s": rate(s.steps),
            "prefill_tokens_per_s": rate(s.prefill_tokens),
            "decode_tokens_per_s": rate(s.decode_tokens),
            "prefill_requests_per_step": s.prefill_requests / steps,
            "decode_requests_per_step": s.decode_requests / steps,
            "budget_utilisation": s.budget_use / steps,
            "first_tokens": s.first_tokens,
            "ttft_mean": s.ttft / firsts,
            "ttft_max": s.ttft_max,
            "ttft_parts_mean": {k: v / firsts for k, v in s.parts.items()},
            "slo_ttft_attainment": slo,
            **self._spec_point(state, rate),
        }
        with self._lock:
            self.points.append(point)
            self.seq += 1

    def _spec_point(self, state: EngineState, rate: Callable[[int], float]) -> dict[str, Any]:
        """Speculative decoding over the last second: draft and accepted tokens per second and
        the acceptance rate (None without drafts); nothing when speculation is off."""
        st = state.spec_decode
        if st is None:
            return {}
        drafted = st.num_draft_tokens - self._last_spec[0]
        accepted = st.num_accepted_tokens - self._last_spec[1]
        self._last_spec = (st.num_draft_tokens, st.num_accepted_tokens)
        return {
            "spec_draft_tokens_per_s": rate(drafted),
            "spec_accepted_tokens_per_s": rate(accepted),
            "spec_acceptance_rate": accepted / drafted if drafted else None,
        }

    def since(self, cursor: int) -> tuple[list[dict[str, Any]], int]:
        """Points appended after ``cursor`` (a previous ``seq``), and the new cursor."""
        with self._lock:
            new = min(self.seq - cursor, len(self.points))
            return list(self.points)[len(self.points) - new :] if new > 0 else [], self.seq
