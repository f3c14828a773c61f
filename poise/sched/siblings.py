"""Admission of ``n`` > 1 siblings: they share the prompt blocks their leader computed.

``poise.core.parallel`` explains the fan-out; this is the scheduler's half of it.
"""

from __future__ import annotations

from collections.abc import Mapping

from poise.core.request import Request, RequestStatus
from poise.kv.manager import KVCacheManager
from poise.sched.gates import Deferral


def leader_blocks(
    request: Request, requests: Mapping[str, Request], kv: KVCacheManager
) -> list[int] | None:
    """The prompt blocks ``request`` takes from its ``prompt_leader`` on admission.

    [] when there is nothing to share (no leader, the leader finished, or the prompt has no
    full block before its last token); None while the leader has not computed them yet: the
    request waits (requests behind it may still be admitted).
    """
    full = (request.num_prompt_tokens - 1) // kv.block_size  # one token short, to sample
    leader = requests.get(request.prompt_leader) if request.prompt_leader else None
    if leader is None or leader.is_finished or full == 0:
        return []
    if leader.status is not RequestStatus.RUNNING or (
        leader.num_computed_tokens < full * kv.block_size
    ):
        return None
    return kv.get_block_ids(leader.request_id)[:full]


# A sibling waits for its leader to compute the shared prompt blocks (``StepPlan.refused``).
WAITING_FOR_LEADER = "waiting_for_leader"


class LeaderGate:
    """Admission's ``DeferGate`` (``gates.py``) for siblings: wait while the leader has not
    computed the blocks ``leader_blocks`` would hand over."""

    def __init__(self, requests: Mapping[str, Request], kv: KVCacheManager) -> None:
        self.requests = requests
        self.kv = kv

    def defer(self, request: Request) -> Deferral | None:
        if request.prompt_leader is None:
            return None
        pending = leader_blocks(request, self.requests, self.kv) is None
        return Deferral(WAITING_FOR_LEADER) if pending else None  # the leader runs in its turn

    def admitted(self, request: Request, cached_blocks: list[int]) -> None:
        return None  # the in-flight gate counts the lookup
