"""The scheduler/executor seam: plain dataclasses of ints, lists and params. No tensors.

One engine step is three calls::

    out = scheduler.schedule(now)            # SchedulerOutput
    result = executor.execute(out)           # ModelRunnerOutput
    deltas, stats = scheduler.update(out, result, now)

``ScheduledRequest`` carries everything the runner needs to build its flat inputs for one
request: the tokens to feed, where they start, and the request's whole block table. The runner
keeps no scheduling state.

The decode rule (``is_decode``) is decided here and nowhere else: a chunk of exactly one token
is a decode. It is one query row attending to its context, whatever that token is: a running
request's last sampled token, a one-token prompt, the one token left after a prefix-cache hit,
or a one-token piece of a recompute. The runner batches it on its decode path, the cost model
prices it as a decode, and ``SchedulerOutput.num_decode_tokens`` / ``StepStats`` count it as
one. A request is decoding (``Request.is_decoding``) when it is one token behind, which is
exactly when its next chunk is a decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from poise.core.logprobs import PromptLogprobSpan, TokenLogprob
from poise.core.request import Request, RequestTimes, SloTargets, is_decode
from poise.core.sampling_params import SamplingParams
from poise.core.structured import GrammarState


@dataclass
class ScheduledRequest:
    request_id: str
    # Tokens fed this step: (prompt + output tokens)[start_position : + len(token_ids)].
    token_ids: list[int]
    # num_computed_tokens before this step = position of token_ids[0].
    start_position: int
    # The request's whole block table after this step's allocation.
    block_ids: list[int]
    # True when this chunk reaches the end of the known tokens, so its last position is sampled.
    sample: bool
    sampling_params: SamplingParams
    # Output tokens generated before this step (index of the token sampled now), for seeding.
    output_index: int
    num_prompt_tokens: int
    # (prompt token ids, output token ids so far): the request's own lists, not copies, set
    # only when it samples this step and its params read past tokens (penalties).
    token_history: tuple[list[int], list[int]] | None = None
    # The prompt positions this chunk's logits score (a request that asked for prompt
    # logprobs, positions not recorded yet); None otherwise, and then no extra logits.
    prompt_logprobs: PromptLogprobSpan | None = None
    # The request's structured-output matcher (read-only here: the runner masks the sampled
    # row's logits with what it allows; the stop rules advance it).
    grammar: GrammarState | None = None
    # Speculative decoding: the last this many of token_ids are draft tokens to verify
    # (sched/speculation.py); the row samples at each of its last 1 + this many positions.
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One token fed: a decode (the module docstring's rule); otherwise a prefill chunk."""
        return is_decode(len(self.token_ids))


@dataclass
class SchedulerOutput:
    step_id: int
    # The engine clock when the step was scheduled (start of the step).
    schedule_time: float = 0.0
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Prompt tokens that requests admitted in this step took from the prefix cache (not fed).
    num_prefix_cache_hit_tokens: int = 0

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_requests(self) -> int:
        return sum(1 for s in self.scheduled if not s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_decode)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    # request_id -> the token sampled for it this step (only requests with sample=True).
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Only for requests that asked (SamplingParams.logprobs / prompt_logprobs): the sampled
    # token's logprob, and one entry per target of the chunk's PromptLogprobSpan.
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request_id -> why the step could not produce its token (its logits were NaN or inf):
    # the engine finishes those requests with an error; they have no sampled token.
    failed: dict[str, str] = field(default_factory=dict)
    # Rows that verified drafts (num_draft_tokens > 0): the drafts the target accepted, a
    # prefix, emitted before sampled_token_ids' token (the target's own at the first rejected
    # position, or the bonus after the last draft), and their logprobs where asked.
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)

    def record_prompt_logprobs(self, request: Request, sched: ScheduledRequest) -> None:
        """Append the prompt logprobs ``sched``'s chunk scored (its span's targets, in order) to
        the request's."""
        if sched.prompt_logprobs is not None and request.prompt_logprobs is not None:
            request.prompt_logprobs.extend(self.prompt_logprobs[sched.request_id])


@dataclass
class RequestDelta:
    """What changed for one request in one step, for its output stream."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    # The stop token id that ended it, if any.
    stop_reason: str | int | None = None
    error_message: str | None = None
    error_param: str | None = None  # Request.error_param
    # Set on the finishing delta only (num_cached_tokens on token deltas too): what metrics
    # and responses need about the request.
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # The request's timestamps (the live object, read on the engine thread): set on every token
    # delta, so TTFT is observed with the first token and each ITL gap with its token.
    times: RequestTimes | None = None
    # Set on the delta with the first token and on the finishing one: the request's class and
    # targets, for per-class SLO metrics.
    slo: SloTargets | None = None
    # The logprobs of new_token_ids (requests with SamplingParams.logprobs), and on the delta
    # with the first token the prompt's (prompt_logprobs; entry 0 is None, as in vLLM).
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def keep_first(self, count: int) -> None:
        """Drop the new tokens (and their logprobs) after the first ``count``: a stop string
        completed inside a multi-token (speculative) delta ends the output there."""
        del self.new_token_ids[count:]
        if self.new_logprobs is not None:
            del self.new_logprobs[count:]


def finishing_delta(request: Request, new_token_ids: Sequence[int] = ()) -> RequestDelta:
    """The last delta of a finished request: its status, reason and what metrics need."""
    return RequestDelta(
        request_id=request.request_id,
        new_token_ids=list(new_token_ids),
        finished=True,
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        error_message=request.error_message,
        error_param=request.error_param,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        times=request.times,
        slo=request.slo,
    )


def annotate_token_delta(
    delta: RequestDelta, request: Request, result: ModelRunnerOutput, first: bool
) -> RequestDelta:
    """``delta`` (one new token) with the cached prefix (for per-request metrics), that token's
    logprob if the request asked, and on the first token the request's class and targets (slo)
    and the prompt's logprobs."""
    delta.num_cached_tokens = request.num_cached_tokens
    if first:
        delta.slo = request.slo
    token = result.logprobs.get(request.request_id)
    if token is not None:  # after the accepted drafts' (speculative decoding), as emitted
        kept = [*result.accepted_logprobs.get(request.request_id, []), token]
        delta.new_logprobs = kept[: len(delta.new_token_ids)]
    if first and request.prompt_logprobs is not None:
        delta.prompt_logprobs = list(request.prompt_logprobs)
    return delta


@dataclass
class StepStats:
    step_id: int
    # When the step was scheduled and when its results were applied (engine clock).
    start_time: float
    end_time: float
    # Tokens fed in prefill chunks and in decodes (one each), by ``is_decode``.
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    # Requests that finished in this step (for metrics and the simulator's records).
    num_finished: int = 0
    # Prompt tokens served from the prefix cache to requests admitted in this step.
    num_prefix_cache_hit_tokens: int = 0
    # Requests fed a prefill chunk / a decode this step (``is_decode``), and the token budget
    # the step was scheduled under (its utilisation = all tokens / budget).
    num_prefill_requests: int = 0
    num_decode_requests: int = 0
    token_budget: int = 0

    @property
    def step_duration(self) -> float:
        return self.end_time - self.start_time

    @property
    def budget_utilisation(self) -> float:
        used = self.num_prefill_tokens + self.num_decode_tokens
        return used / self.token_budget if self.token_budget > 0 else 0.0

    @classmethod
    def of(
        cls,
        output: SchedulerOutput,
        now: float,
        *,
        running: int,
        waiting: int,
        kv_cache_usage: float,
        finished: int,
        budget: int,
    ) -> StepStats:
        """The stats of the step ``output`` scheduled, its results applied at ``now``."""
        return cls(
            step_id=output.step_id,
            start_time=output.schedule_time,
            end_time=now,
            num_prefill_tokens=output.num_prefill_tokens,
            num_decode_tokens=output.num_decode_tokens,
            num_running=running,
            num_waiting=waiting,
            kv_cache_usage=kv_cache_usage,
            num_preemptions=len(output.preempted_request_ids),
            num_finished=finished,
            num_prefix_cache_hit_tokens=output.num_prefix_cache_hit_tokens,
            num_prefill_requests=output.num_prefill_requests,
            num_decode_requests=output.num_decode_tokens,
            token_budget=budget,
        )
