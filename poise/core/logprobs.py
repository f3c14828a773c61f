"""Log probabilities as the engine hands them out: plain numbers, no tensors, no text.

``TokenLogprob`` is one position: the token that is there (sampled, or the prompt's own
token), its log probability under the model's raw distribution (log_softmax of the logits,
before temperature or any other processing: vLLM's default ``raw_logprobs``), its rank (1 = the
most likely token) and the ``top`` most likely tokens with theirs, most likely first.

Prompt logprobs need the logits of every prompt position, which a prefill step does not
otherwise compute. The scheduler asks for them per chunk (``prompt_logprob_span``): the chunk
row ``row`` predicts prompt position ``row + start + 1``; the runner returns one
``TokenLogprob`` per target, in order. A request that wants prompt logprobs does not read the
prefix cache (as in vLLM): a cached block holds K/V, not the logits its positions predicted, so
every prompt position must be fed again anyway. Positions already recorded (a recompute after
preemption) are not asked for twice.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's default --max-logprobs and OpenAI's top_logprobs limit.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    # The most likely tokens at this position (at most the request's k), most likely first.
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class PromptLogprobSpan:
    """Which prompt positions one chunk scores: chunk rows ``row .. row + len(targets) - 1``
    predict the tokens ``targets`` (prompt positions ``start + row + 1 ..``)."""

    row: int
    targets: tuple[int, ...]


def prompt_logprob_span(
    prompt_token_ids: list[int], start: int, num_tokens: int, num_recorded: int
) -> PromptLogprobSpan | None:
    """The span of a chunk ``[start, start + num_tokens)`` whose logits score prompt positions
    not recorded yet (``num_recorded`` = positions 0 .. num_recorded - 1 already are; position
    0 has no logprob). None when the chunk scores none."""
    first = max(start + 1, num_recorded)
    end = min(start + num_tokens + 1, len(prompt_token_ids))
    if first >= end:
        return None
    return PromptLogprobSpan(first - 1 - start, tuple(prompt_token_ids[first:end]))
