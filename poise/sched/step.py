"""The step plan: what one step will compute, built up by admission (``admission.py``) while it
walks the policy's candidates, and the ``SchedulerOutput`` it becomes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from poise.core.outputs import ScheduledRequest, SchedulerOutput
from poise.core.request import Request
from poise.kv.manager import KVCacheManager

# Why a candidate got nothing this step (``StepPlan.refused``).
NO_SLOT = "no_slot"  # max_num_seqs requests run, and none may be displaced
CLASS_SLOTS = "class_slots"  # the free slots are held for other classes (shares.py)
RESERVED_TOKENS = "reserved_tokens"  # the budget left is held for other classes, or paced
WHOLE_PROMPT = "whole_prompt"  # chunked prefill is off and the prompt does not fit whole
KV_BLOCKS = "kv_blocks"  # its blocks would eat into the reserve (kv free-block margin)
MAKING_ROOM = "making_room"  # a running request lost its blocks this step: no admissions
QUEUE_BLOCKED = "queue_blocked"  # a request ahead of it could not go and blocks the queue


@dataclass
class StepPlan:
    """What one step will compute: per request its tokens, who was preempted, who was refused."""

    budget: int
    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Per request admitted in this step: prompt tokens it took from the prefix cache.
    cached_tokens: dict[str, int] = field(default_factory=dict)
    # A running request lost its blocks for another's growth this step: admission stops, so the
    # freed blocks go to the running requests (as in vLLM); admitting onto them is what made
    # requests preempt each other for ever (docs/reliability.md).
    made_room: bool = False
    # Per speculating request: the draft tokens it verifies (the last of its tokens this step).
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # Per candidate the walk reached that got no tokens: why (the constants above, or a
    # deferral gate's reason).
    refused: dict[str, str] = field(default_factory=dict)
    _ids: set[str] = field(default_factory=set)

    def add(self, request: Request, num_tokens: int, cached_tokens: int = 0) -> None:
        self.items.append((request, num_tokens))
        self._ids.add(request.request_id)
        self.budget -= num_tokens
        if cached_tokens:
            self.cached_tokens[request.request_id] = cached_tokens

    def refuse(self, request: Request, reason: str) -> None:
        self.refused[request.request_id] = reason

    def contains(self, request: Request) -> bool:
        return request.request_id in self._ids

    def remove(self, request: Request) -> None:
        """Take a request back out of the step (it was preempted after being scheduled)."""
        if request.request_id not in self._ids:
            return
        self._ids.discard(request.request_id)
        self.cached_tokens.pop(request.request_id, None)
        self.drafts.pop(request.request_id, None)
        for i, (r, n) in enumerate(self.items):
            if r is request:
                del self.items[i]
                self.budget += n
                return


def build_output(plan: StepPlan, step_id: int, now: float, kv: KVCacheManager) -> SchedulerOutput:
    """The step as the executor sees it: per request its tokens, positions and block table."""
    out = SchedulerOutput(step_id=step_id, schedule_time=now)
    for request, n in plan.items:
        start = request.num_computed_tokens
        drafts = plan.drafts.get(request.request_id, [])
        known = n - len(drafts)  # tokens of the request itself; drafts follow them
        sample = start + known == request.num_tokens
        out.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.token_ids_slice(start, start + known) + drafts,
                start_position=start,
                block_ids=list(kv.get_block_ids(request.request_id)),
                sample=sample,
                sampling_params=request.sampling_params,
                output_index=request.num_output_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
                token_history=(request.prompt_token_ids, request.output_token_ids)
                if sample and request.sampling_params.needs_token_history
                else None,
                prompt_logprobs=request.prompt_logprob_span(start, n),
                grammar=request.grammar,
                num_draft_tokens=len(drafts),
            )
        )
    out.preempted_request_ids = plan.preempted_ids
    out.num_prefix_cache_hit_tokens = sum(plan.cached_tokens.values())
    return out
