"""Finding the sampled rows whose logits are not finite (NaN or inf), cheaply.

A model can produce NaN or infinite logits for one request (an overflow in half precision, a
bad weight reached only by some tokens). Sampling such a row gives a garbage token, or makes
``torch.multinomial`` raise and fail the whole step. Instead the runner reports the request as
failed (``ModelRunnerOutput.failed``) and the engine finishes only that request with an error.

The common case costs one reduction over the step's logits: the sum of all of them is finite
whenever every logit is (a sum can overflow to inf only if logits reach ~1e33, and then the
exact per-row check below finds nothing and nothing fails). Only when the sum is not finite
are the rows checked one by one, and the bad ones zeroed so that the sampler, the logprobs and
the structured-output mask see ordinary numbers; their tokens are dropped from the output.
"""

from __future__ import annotations

import torch

NONFINITE_MESSAGE = "the model produced non-finite logits (NaN or inf) for this request"


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """Indices of the rows of ``logits`` ([S, V]) holding a NaN or an inf; those rows are set
    to zeros in place. One reduction when every row is finite."""
    if bool(torch.isfinite(logits.sum())):
        return []
    bad = ~torch.isfinite(logits).all(dim=-1)
    rows = [int(i) for i in bad.nonzero().flatten().tolist()]
    if rows:
        logits[bad] = 0.0
    return rows
