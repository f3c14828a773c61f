"""Parallel sampling (``n`` > 1) as child requests that share the prompt's KV blocks.

A request with ``n`` samples becomes ``n`` engine requests (vLLM V1's fan-out): child ``i`` is
``f"{i}_{request_id}"`` with ``n=1`` and, when the parent is seeded, ``seed + i`` (vLLM's rule),
so the samples differ from one another and the same request gives the same ``n`` samples again.

The prompt is computed once: child 0 leads, and every other child names it as its
``prompt_leader``. The scheduler does not admit a follower until the leader has computed the
prompt's full blocks, then gives it those very blocks (their reference counts go up; nothing
is copied), whether or not prefix caching is on. A follower computes only the prompt's last
partial block (fewer than ``block_size`` tokens; a whole block when the prompt fills its last
block exactly, since a position must be left to sample) before its first token. So only the
leader scores the prompt (``prompt_logprobs``): followers never feed the shared positions, and
the prompt's logprobs are the same for every sample (vLLM returns them once per request).
"""

from __future__ import annotations

import dataclasses

from poise.core.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Child:
    request_id: str
    index: int
    params: SamplingParams
    # The child that computes the shared prompt (None for that child itself).
    prompt_leader: str | None


def child_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def fan_out(request_id: str, params: SamplingParams) -> list[Child]:
    """The engine requests for one request: itself when ``n == 1``, else ``n`` children."""
    if params.n == 1:
        return [Child(request_id, 0, params, None)]
    leader = child_id(request_id, 0)
    children = []
    for i in range(params.n):
        seed = None if params.seed is None else params.seed + i
        prompt_lp = params.prompt_logprobs if i == 0 else None
        child = dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_lp)
        children.append(Child(child_id(request_id, i), i, child, None if i == 0 else leader))
    return children
