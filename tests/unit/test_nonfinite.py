"""runner/nonfinite.py: which sampled rows hold NaN or inf, at one reduction when none does."""

from __future__ import annotations

import math

import torch

from poise.runner.nonfinite import nonfinite_rows


def test_finite_logits_are_left_alone_even_when_their_sum_overflows() -> None:
    logits = torch.full((3, 8), 3e38)  # finite, but their sum is inf: the exact check clears it
    assert nonfinite_rows(logits) == [] and torch.all(logits == 3e38)
    assert nonfinite_rows(torch.randn(4, 16)) == []


def test_nan_and_infinite_rows_are_found_and_zeroed() -> None:
    logits = torch.randn(5, 16)
    keep = logits.clone()
    logits[1, 3], logits[3, 0], logits[4, 15] = math.nan, -math.inf, math.inf
    assert nonfinite_rows(logits) == [1, 3, 4]
    assert torch.all(logits[[1, 3, 4]] == 0) and torch.equal(logits[[0, 2]], keep[[0, 2]])
