"""What the offline API returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``.

Code written against vLLM reads ``output.prompt``, ``output.outputs[0].text`` and
``output.outputs[0].token_ids`` unchanged. poise adds its latency breakdown (queue, prefill,
TTFT, TPOT, ITL, E2E from ``core.timing.derive``) under ``metrics``, and why a request failed
under ``error_message``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from poise.core.logprobs import TokenLogprob
from poise.core.timing import RequestMetrics


@dataclass
class Logprob:
    """vLLM's: a token's log probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape for one position: token id -> Logprob, the position's own token first, then
# the most likely alternatives (so k or k + 1 entries).
PositionLogprobs = dict[int, Logprob]


def position_logprobs(lp: TokenLogprob, decode: Callable[[int], str | None]) -> PositionLogprobs:
    out = {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id))}
    for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
        if tid not in out:
            out[tid] = Logprob(value, rank, decode(tid))
    return out


@dataclass
class CompletionOutput:
    """One generated sequence: ``RequestOutput.outputs`` holds ``n`` of them, by ``index``."""

    index: int
    text: str
    token_ids: list[int]
    # With SamplingParams.logprobs: the sum of the sampled tokens' logprobs, and one
    # PositionLogprobs per generated token; None otherwise, as in vLLM.
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    # "stop" (EOS, a stop token or a stop string), "length", "abort", "error" or "rejected";
    # None while unfinished.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the sequence; None for EOS or length.
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    # The prompt text; None when the prompt was given as token ids.
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With SamplingParams.prompt_logprobs: one PositionLogprobs per prompt token (the first
    # None: nothing predicts it).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # poise's latency breakdown for this request (seconds), set when it finishes.
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error_message: str | None = None
