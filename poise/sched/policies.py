"""The step plan: what one step will compute, built up while the scheduler walks its candidates.

The policies that order those candidates are in ``ordering.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from poise.core.request import Request


@dataclass
class StepPlan:
    """What one step will compute, built up while the scheduler walks its queues."""

    budget: int
    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Per request admitted in this step: prompt tokens it took from the prefix cache.
    cached_tokens: dict[str, int] = field(default_factory=dict)
    _ids: set[str] = field(default_factory=set)

    def add(self, request: Request, num_tokens: int, cached_tokens: int = 0) -> None:
        self.items.append((request, num_tokens))
        self._ids.add(request.request_id)
        self.budget -= num_tokens
        if cached_tokens:
            self.cached_tokens[request.request_id] = cached_tokens

    def contains(self, request: Request) -> bool:
        return request.request_id in self._ids

    def remove(self, request: Request) -> None:
        """Take a request back out of the step (it was preempted after being scheduled)."""
        if request.request_id not in self._ids:
            return
        self._ids.discard(request.request_id)
        self.cached_tokens.pop(request.request_id, None)
        for i, (r, n) in enumerate(self.items):
            if r is request:
                del self.items[i]
                self.budget += n
                return
