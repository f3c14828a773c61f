"""Token-level stop conditions, checked after each sampled token.

A structured-output request's matcher advances here with each token that is not an end token;
a complete grammar stops the request, and one that cannot go on (a dead end the mask found, or a
token it refuses) fails it naming the field. Stop *strings* need text, so they are checked by
the detokenizer, which then finishes the request through the engine; only token ids and lengths
are decided here.
"""

from __future__ import annotations

from poise.core.request import Request, RequestStatus


def check_stop(request: Request, token: int, max_len: int) -> RequestStatus | None:
    """The finished status this token causes, or None to keep generating."""
    params = request.sampling_params
    grammar = request.grammar
    if grammar is not None and grammar.is_failed():  # before the end token it may have offered
        return _grammar_failed(request)
    if not params.ignore_eos and token in request.eos_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if token in params.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if grammar is not None:
        if not grammar.accept_token(token):
            return _grammar_failed(request)
        if grammar.is_terminated():  # complete: end now rather than sample the forced EOS
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_until_stop(
    request: Request, tokens: list[int], now: float, max_len: int
) -> tuple[list[int], RequestStatus | None]:
    """Append a step's tokens to ``request`` one at a time under the stop rules: (those kept,
    the finished status of the last or None). More than one token: speculative decoding's
    accepted drafts and then the target's own; each token after the first follows a kept
    draft, whose KV the step computed (``num_computed_tokens`` moves past it)."""
    kept: list[int] = []
    for i, token in enumerate(tokens):
        request.num_computed_tokens += i > 0
        request.output_token_ids.append(token)
        request.times.token_times.append(now)
        kept.append(token)
        status = check_stop(request, token, max_len)
        if status is not None:
            return kept, status
    return kept, None


def _grammar_failed(request: Request) -> RequestStatus:
    """The mask allowed a token the grammar refuses, or offered only the end at a dead end (the
    sampled token then says nothing, so the message names none): the grammar needs bytes the
    vocabulary cannot spell, and llguidance's mask and matcher disagree there (its issue 366).
    Choices and the bytes a grammar forces from its start are refused before generating
    (text/grammar.py); this is the rest, the request's own fault: a 400 naming the field."""
    spec = request.sampling_params.structured_outputs
    request.error_param = spec.source_field if spec is not None else None
    request.error_message = (
        "structured output: the grammar cannot go on from the text generated so far: it needs "
        "bytes no token of this model produces"
    )
    return RequestStatus.FINISHED_ERROR
