"""Token-level stop conditions, checked after each sampled token.

Stop *strings* need text, so they are checked by the detokenizer, which then finishes the
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
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_len:
        return RequestStatus.FINISHED_LENGTH
    return None
