"""Token-level stop conditions, checked after each sampled token.

A structured-output request's matcher advances here with each token that is not an end token,
and a complete grammar stops the request. Stop *strings* need text, so they are checked by the detokenizer, which then finishes the
request through the engine; only token ids and lengths are decided here.
"""

from __future__ import annotations

from poise.core.request import Request, RequestStatus


def check_stop(request: Request, token: int, max_len: int) -> RequestStatus | None:
    """The finished status this token causes, or None to keep generating."""
    params = request.sampling_params
    if not params.ignore_eos and token in request.eos_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if token in params.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    grammar = request.grammar
    if grammar is not None:
        if not grammar.accept_token(token):
            # The mask allowed it: the grammar needs bytes the vocabulary cannot spell, and
            # llguidance's mask and matcher disagree there (its issue 366). Choices and the bytes
            # a grammar forces from its start are checked before generating (text/grammar.py).
            request.error_message = (
                f"structured output: token {token} broke the grammar (the grammar may need "
                "bytes no token of this model produces)"
            )
            return RequestStatus.FINISHED_ERROR
        if grammar.is_terminated():  # complete: end now rather than sample the forced EOS
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_len:
        return RequestStatus.FINISHED_LENGTH
    return None
