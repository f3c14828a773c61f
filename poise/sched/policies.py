"""Step plans and the request orders that distinguish scheduling policies.

Kept apart from the scheduler so a new policy is a new ordering function, not a new branch in
the step loop.
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
    _ids: set[str] = field(default_factory=set)

    def add(self, request: Request, num_tokens: int) -> None:
        self.items.append((request, num_tokens))
        self._ids.add(request.request_id)
        self.budget -= num_tokens

    def contains(self, request: Request) -> bool:
        return request.request_id in self._ids

    def remove(self, request: Request) -> None:
        """Take a request back out of the step (it was preempted after being scheduled)."""
        if request.request_id not in self._ids:
            return
        self._ids.discard(request.request_id)
        for i, (r, n) in enumerate(self.items):
            if r is request:
                del self.items[i]
                self.budget += n
                return
