"""What the offline API returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``.

Code written against vLLM reads ``output.prompt``, ``output.outputs[0].text`` and
``output.outputs[0].token_ids`` unchanged. poise adds its latency breakdown (queue, prefill,
TTFT, TPOT, ITL, E2E from ``core.timing.derive``) under ``metrics``, and why a request failed
under ``error_message``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from poise.core.timing import RequestMetrics


@dataclass
class CompletionOutput:
    """One generated sequence: ``RequestOutput.outputs`` holds ``n`` of them, by ``index``."""

    index: int
    text: str
    token_ids: list[int]
    # Log probabilities are not computed yet (SamplingParams.logprobs is refused), so these
    # stay None, as in vLLM when logprobs were not asked for.
    cumulative_logprob: float | None = None
    logprobs: Any = None
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
    prompt_logprobs: Any = None  # not computed yet (SamplingParams.prompt_logprobs is refused)
    # poise's latency breakdown for this request (seconds), set when it finishes.
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error_message: str | None = None
