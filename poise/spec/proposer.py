"""The proposer interface: up to ``k`` draft tokens that may follow a request's tokens.

A proposer is deterministic given the request's tokens (its draft distribution is a point
mass), which is what makes verification exact with one rule for greedy and sampled requests:
the target samples its own token at each draft position as it would without speculation, and
a draft token is accepted while it equals the target's (``runner/verify.py`` says why that is
rejection sampling). A proposer may return fewer than ``k`` tokens, or none.
"""

from __future__ import annotations

from typing import Protocol

from poise.core.request import Request


class Proposer(Protocol):
    def propose(self, request: Request, k: int) -> list[int]:
        """At most ``k`` tokens guessed to follow ``request``'s prompt + output tokens."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: drop whatever is held for it."""
        ...
