"""A request's state as the scheduler sees it: tokens, progress, status and timestamps.

The vLLM framing: ``num_computed_tokens`` (tokens whose KV is in the cache) catches up with
``num_tokens`` (prompt + generated). Prefill and decode are not separate phases: a request whose
``num_computed_tokens == num_tokens - 1`` is decoding; anything further behind is prefilling
(possibly in chunks, possibly again after a preemption). ``is_decode`` is that rule, the only
place it is written (see ``outputs.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from poise.core.logprobs import PromptLogprobSpan, TokenLogprob, prompt_logprob_span
from poise.core.sampling_params import SamplingParams
from poise.core.structured import GrammarState


def is_decode(num_new_tokens: int) -> bool:
    """The decode rule: feeding exactly one token is a decode (one query row); more, a prefill."""
    return num_new_tokens == 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish_reason for finished states."""
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_REJECTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass
class RequestTimes:
    """Timestamps (seconds, on whatever clock the engine was given). None until they happen."""

    arrival: float
    # When the engine took the request in (after the way in: chat template, tokenization and
    # the wait for the engine thread). None where the caller never set it: then = arrival.
    enqueued: float | None = None
    first_scheduled: float | None = None
    # Seconds of the steps that fed this request prompt chunks before its first token: the
    # compute part of prefill (the rest of first_scheduled -> first_token is waiting between
    # chunks while other steps ran, the seed's "scheduling time until the first token").
    prefill_compute: float = 0.0
    first_token: float | None = None
    # One entry per output token, when the step that produced it ended.
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


@dataclass(frozen=True)
class SloTargets:
    """A request's traffic class and the latency it was promised (seconds; None: no target)."""

    class_name: str = "default"
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Prompt tokens served from the prefix cache at the last admission.
    num_cached_tokens: int = 0
    stop_reason: str | int | None = None
    # Why a request was rejected or failed, for the client.
    error_message: str | None = None
    # The request field at fault when a failure is the request's own (the server answers 400
    # naming it, not 500): a grammar this model's vocabulary cannot complete.
    error_param: str | None = None
    # Scheduling inputs: lower priority values go first (vLLM); class and targets set on entry.
    priority: int = 0
    slo: SloTargets = field(default_factory=SloTargets)
    # A sibling of the same n > 1 request that computes the shared prompt (core/parallel.py):
    # this one is admitted once that one holds the prompt's full blocks, and shares them.
    prompt_leader: str | None = None
    # The structured-output matcher (sampling_params.structured_outputs), advanced with each
    # accepted token by the stop rules; None when unconstrained.
    grammar: GrammarState | None = None
    # Predictive admission, when its forecast came near the target: (when it was admitted, the
    # forecast's seconds from then to the first token), to learn how late first tokens come.
    admission_forecast: tuple[float, float] | None = None
    times: RequestTimes = field(init=False)
    # Per prompt position, once computed (SamplingParams.prompt_logprobs; position 0: None).
    prompt_logprobs: list[TokenLogprob | None] | None = field(init=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(arrival=self.arrival_time)
        wants = self.sampling_params.prompt_logprobs is not None
        self.prompt_logprobs = [None] if wants else None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: the prefix cache is not read (a
        cached block has the K/V but not the logits its positions predicted)."""
        lp = self.prompt_logprobs
        return lp is not None and len(lp) < self.num_prompt_tokens

    def prompt_logprob_span(self, start: int, num_tokens: int) -> PromptLogprobSpan | None:
        """The prompt positions the chunk ``[start, start + num_tokens)`` must score."""
        if not self.needs_prompt_logprobs:
            return None
        assert self.prompt_logprobs is not None
        return prompt_logprob_span(
            self.prompt_token_ids, start, num_tokens, len(self.prompt_logprobs)
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        """One token behind: its next chunk is a decode (``is_decode``)."""
        return is_decode(self.num_tokens - self.num_computed_tokens)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
