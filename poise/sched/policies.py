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


def is_partial_prefill(request: Request) -> bool:
    """More than one token behind: a chunked prefill (or a recompute) is still in progress."""
    return request.num_tokens - request.num_computed_tokens > 1


def order_running(running: list[Request]) -> tuple[list[Request], list[Request]]:
    """Split running requests into (unfinished prefills, decodes), each in admission order."""
    partial = [r for r in running if is_partial_prefill(r)]
    decodes = [r for r in running if not is_partial_prefill(r)]
    return partial, decodes
