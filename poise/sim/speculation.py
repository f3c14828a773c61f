"""Speculative decoding in the simulator: who proposes and how many drafts a verify keeps.

The scheduler's part runs unchanged (``sched/speculation.py``: the depth rule, the budget, KV
slots and rollback); only the model's two roles are modelled here. ``SimProposer`` stands for
a proposer that always has a draft: it offers ``k`` copies of the simulated token (their
identity does not matter, only how many). ``accepted_drafts`` draws how many of a row's ``k``
drafts the target keeps: each one with probability ``acceptance_rate`` once all before it were
kept (the per-token rate the depth rule estimates per request), from the executor's seeded
random stream, so a run is deterministic for its seed.

The acceptance rate is the workload's (and the proposer's) property, not the accelerator's:
``poise simulate --spec-acceptance-rate`` sets it, e.g. from a measured run's
``spec_decode`` counters (``acceptance_from_counters``); ``--spec-draft-rate`` the share of
decode steps the proposer has a draft for at all (``draft_rate_from_counts``; 1 by default).
"""

from __future__ import annotations

import random

from poise.core.request import Request


class SimProposer:
    """``k`` drafts on a ``draft_rate`` share of the calls (a prompt lookup finds no earlier
    occurrence of the suffix on the others), from its own seeded stream."""

    def __init__(self, token_id: int, draft_rate: float = 1.0, seed: int = 0) -> None:
        self.token_id = token_id
        self.draft_rate = draft_rate
        self._rng = random.Random(f"spec-draft|{seed}")

    def propose(self, request: Request, k: int) -> list[int]:
        if self.draft_rate < 1.0 and self._rng.random() >= self.draft_rate:
            return []
        return [self.token_id] * k

    def forget(self, request_id: str) -> None:
        """Nothing is held per request."""


def accepted_drafts(rng: random.Random, acceptance_rate: float, k: int) -> int:
    """How many of ``k`` drafts are kept: a prefix, each kept with ``acceptance_rate``."""
    kept = 0
    while kept < k and rng.random() < acceptance_rate:
        kept += 1
    return kept


def draft_rate_from_counts(
    num_drafts: float, num_accepted: float, output_tokens: float, num_requests: float
) -> float:
    """The share of decode steps that verified drafts: each request's first token comes from
    its prefill and each decode step emits 1 + its accepted drafts, so the decode steps were
    ``output_tokens - num_requests - num_accepted``."""
    steps = output_tokens - num_requests - num_accepted
    return min(1.0, num_drafts / steps) if steps > 0 else 0.0


def mean_accepted(acceptance_rate: float, k: int) -> float:
    """Expected drafts kept of ``k``: a + a^2 + ... + a^k."""
    return sum(acceptance_rate**i for i in range(1, k + 1))


def acceptance_from_counters(num_drafts: float, num_accepted: float, k: int) -> float:
    """The per-token rate ``a`` whose ``mean_accepted(a, k)`` is the measured accepted tokens
    per draft (vLLM's counters); exact for drafts of ``k`` tokens, an underestimate where some
    were shorter (bisection: ``mean_accepted`` grows with ``a``)."""
    if num_drafts <= 0:
        raise ValueError("acceptance_from_counters: no drafts were verified")
    target = num_accepted / num_drafts
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_accepted(mid, k) < target else (lo, mid)
    return (lo + hi) / 2
